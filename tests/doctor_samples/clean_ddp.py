"""A well-written DDP training script: `disttrain doctor` must report nothing here.

Launch: torchrun --standalone --nproc-per-node=2 clean_ddp.py
"""

import datetime
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

logger = logging.getLogger(__name__)
ACCUM_STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def save_checkpoint(model, optimizer, epoch, path):
    tmp = f"{path}.tmp"
    torch.save({"model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()

    model = Net().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = TensorDataset(torch.randn(1024, 32), torch.randn(1024, 1))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)

    start_epoch = 0
    if os.path.exists("ckpt.pt"):
        state = torch.load("ckpt.pt", map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, 10):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last = (step + 1) % ACCUM_STEPS == 0
            if last:
                loss = nn.functional.mse_loss(model(x), y) / ACCUM_STEPS
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = nn.functional.mse_loss(model(x), y) / ACCUM_STEPS
                    loss.backward()
        total = loss.detach() * ACCUM_STEPS
        dist.all_reduce(total)
        if rank == 0:
            logger.info("epoch %d loss %.4f", epoch, total.item() / dist.get_world_size())
            print(f"epoch {epoch} done")
            save_checkpoint(model, optimizer, epoch, "ckpt.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
