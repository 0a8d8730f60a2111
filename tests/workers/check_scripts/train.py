"""A small training script for `disttrain run --check` (tests/launch/test_run_check.py): the
correct form by default, bugs with `--bug NAME[,NAME]`. The model and data are tiny; two
epochs of 4 steps on each of 2 ranks.

    python train.py OUT [--strategy ddp|manual|fsdp2] [--bug NAME[,NAME]]

Under DDP each step accumulates two micro-batches, the first under no_sync(). Bugs:
bypass (forward through DDP's .module), rank_init (a seed per rank, gradients averaged
by hand), no_sampler (every rank iterates the whole dataset), no_set_epoch, opt_first
(the optimizer built before fully_shard), accum_no_sync (no no_sync()), sampler_seed (a
DistributedSampler seeded per rank), split_twice (a per-rank Subset split again by a
DistributedSampler), no_zero_grad (zero_grad on every other step only), unused (a layer
DDP waits for that the forward never uses), one_class (cross_entropy over one output column:
every gradient zero). Each epoch starts with a peek at the loader before set_epoch, as
scripts do to read the batch size. OUT/params.pt: the final parameters.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="ddp")
parser.add_argument("--bug", default="")
args = parser.parse_args()
bugs = set(args.bug.split(","))  # several at once: NAME,NAME

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank if "rank_init" in bugs else 0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class WithSpare(nn.Module):
    """The model and a layer its forward never calls."""

    def __init__(self, body):
        super().__init__()
        self.body, self.spare = body, nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


if "unused" in bugs:
    model = WithSpare(model)

data_gen = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(64, 8, generator=data_gen), torch.randn(64, 1, generator=data_gen))
if "split_twice" in bugs:
    dataset = Subset(dataset, range(rank, len(dataset), world))
seed = 3 + rank if "sampler_seed" in bugs else 3
sampler = None if "no_sampler" in bugs else DistributedSampler(dataset, shuffle=True, seed=seed)
loader = DataLoader(dataset, batch_size=8, sampler=sampler)

if args.strategy == "fsdp2":
    from torch.distributed.fsdp import fully_shard

    if "opt_first" in bugs:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model)
    if "opt_first" not in bugs:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained = model
elif args.strategy == "ddp":
    trained = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
else:
    trained = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


loss_fn = nn.functional.cross_entropy if "one_class" in bugs else nn.functional.mse_loss


def backward(x, y):
    """Two micro-batches under DDP (no_sync on the first, but for the accum_no_sync bug)."""
    forward = trained.module if "bypass" in bugs else trained
    if args.strategy != "ddp" or "bypass" in bugs:
        loss_fn(forward(x), y).backward()
        return
    half = len(x) // 2
    with trained.no_sync() if "accum_no_sync" not in bugs else contextlib.nullcontext():
        (loss_fn(forward(x[:half]), y[:half]) / 2).backward()
    (loss_fn(forward(x[half:]), y[half:]) / 2).backward()


for epoch in range(2):
    batch_size = len(next(iter(loader))[0])
    if sampler is not None and "no_set_epoch" not in bugs:
        sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if "no_zero_grad" not in bugs or i % 2 == 0:
            optimizer.zero_grad()
        backward(x, y)
        if args.strategy == "manual":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()

if args.strategy != "fsdp2" and rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "params.pt"))
dist.destroy_process_group()
