# issue: https://github.com/pytorch/pytorch/issues/11324
# summary: DistributedSampler seeds its shuffle with the epoch; without set_epoch every epoch has the same order (and it was undocumented)
# family: missing set_epoch
import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def train(loader, model, opt):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    train_sampler = DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=dist.get_rank())  # expect: sampler-without-set-epoch
    loader = DataLoader(ds, batch_size=8, sampler=train_sampler)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(int(os.environ.get("EPOCHS", "10"))):
        train(loader, model, opt)


if __name__ == "__main__":
    main()
