"""A `dt.Job(check=True)` script (tests/launch/test_run_check.py): a small MLP for 6 steps;
with `--bug edit`, rank 1 changes a parameter in place after step 2, outside the
optimizer; with `--bug one_rank`, rank 0 alone all-reduces the loss at step 3 (to print
it), a collective rank 1 never joins.

    python job_edit.py OUT [--bug edit|one_rank]
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import disttrain as dt

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--bug", default="")
args = parser.parse_args()

g = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
with dt.Job(args.out, strategy="ddp", checkpoint_every=0, check=True, progress=False) as job:
    model = job.wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = job.loader(dataset, batch_size=8)
    job.resume(model=model, optimizer=optimizer)
    for x, y in job.steps(loader, max_steps=6):
        loss = nn.functional.mse_loss(model(x), y)
        job.backward(loss)
        if args.bug == "one_rank" and job.step == 3 and job.info.rank == 0:
            torch.distributed.all_reduce(loss.detach())
        if args.bug == "edit" and job.step == 2 and job.info.rank == 1:
            with torch.no_grad():
                dt.unwrap(model)[0].bias.add_(0.5)
