# issue: https://github.com/pytorch/tutorials/pull/2049
# summary: review of the DDP tutorial: once _save_checkpoint runs only under `if self.gpu_id == 0`, it must not call a collective, or the other ranks never join it
# family: collective under a rank guard
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every

    def _save_checkpoint(self, epoch):
        dist.barrier()  # expect: collective-under-rank-guard
        ckp = self.model.module.state_dict()
        torch.save(ckp, "checkpoint.pt.tmp")
        os.replace("checkpoint.pt.tmp", "checkpoint.pt")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self.train_data.sampler.set_epoch(epoch)
            for source, targets in self.train_data:
                self.optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.model(source), targets).backward()
                self.optimizer.step()
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
