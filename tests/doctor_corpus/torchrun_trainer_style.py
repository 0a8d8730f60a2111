"""Written for the corpus in the shape of a tutorial's torchrun trainer (pytorch/examples
ddp-tutorial-series; not a copy): a Runner that saves from `if self.gpu_id == 0`,
gpu_id read from LOCAL_RANK (one writer per node)."""
import datetime
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class Runner:
    def __init__(self, net, batches, opt, every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.net = DDP(net.to(self.gpu_id), device_ids=[self.gpu_id])
        self.batches = batches
        self.opt = opt
        self.every = every

    def _one_pass(self, epoch):
        self.batches.sampler.set_epoch(epoch)
        for inputs, labels in self.batches:
            self.opt.zero_grad()
            loss = F.cross_entropy(self.net(inputs.to(self.gpu_id)), labels.to(self.gpu_id))
            loss.backward()
            self.opt.step()

    def _store(self, epoch):
        torch.save(self.net.module.state_dict(), "weights.pt.tmp")
        os.replace("weights.pt.tmp", "weights.pt")
        print(f"weights stored after pass {epoch}")

    def fit(self, passes):
        for epoch in range(passes):
            self._one_pass(epoch)
            if self.gpu_id == 0 and epoch % self.every == 0:
                self._store(epoch)


def main(data, net, opt, every, passes):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    batches = DataLoader(data, batch_size=32, shuffle=False, sampler=DistributedSampler(data))
    Runner(net, batches, opt, every).fit(passes)
    destroy_process_group()
