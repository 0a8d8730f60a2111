"""Written for the corpus in the shape of pytorch/examples
ddp-tutorial-series/multigpu_torchrun.py (not a copy): a Trainer that saves from
`if self.gpu_id == 0`, gpu_id read from LOCAL_RANK (one writer per node)."""
import datetime
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            loss = F.cross_entropy(self.model(source.to(self.gpu_id)), targets.to(self.gpu_id))
            loss.backward()
            self.optimizer.step()

    def _save_checkpoint(self, epoch):
        torch.save(self.model.module.state_dict(), "checkpoint.pt.tmp")
        os.replace("checkpoint.pt.tmp", "checkpoint.pt")
        print(f"Epoch {epoch} | Training checkpoint saved")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def main(dataset, model, optimizer, save_every, total_epochs):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=10))
    loader = DataLoader(dataset, batch_size=32, shuffle=False, sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, save_every).train(total_epochs)
    destroy_process_group()
