# issue: https://github.com/pytorch/tutorials/pull/2049
# summary: review of the DDP tutorial: once the checkpoint method runs only under `if self.gpu_id == 0`, it must not call a collective, or the other ranks never join it
# family: collective under a rank guard
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Runner:
    def __init__(self, net, batches, opt, every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.net = DDP(net.to(self.gpu_id), device_ids=[self.gpu_id])
        self.batches, self.opt, self.every = batches, opt, every

    def _store(self, epoch):
        dist.barrier()  # expect: collective-under-rank-guard
        weights = self.net.module.state_dict()
        torch.save(weights, "weights.pt.tmp")
        os.replace("weights.pt.tmp", "weights.pt")

    def fit(self, passes):
        for epoch in range(passes):
            self.batches.sampler.set_epoch(epoch)
            for inputs, labels in self.batches:
                self.opt.zero_grad()
                torch.nn.functional.cross_entropy(self.net(inputs), labels).backward()
                self.opt.step()
            if self.gpu_id == 0 and epoch % self.every == 0:
                self._store(epoch)


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
