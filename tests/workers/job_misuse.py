"""A rank of a 2-rank FSDP job that builds the optimizer before `job.wrap()` (test_job.py)."""

import sys

import torch

import disttrain as dt
from disttrain.demo import MLP, MLPConfig

with dt.Job(sys.argv[1], strategy="fsdp") as job:  # FSDP2 replaces the parameters
    raw = MLP(MLPConfig())
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)  # the mistake: before wrap
    model = job.wrap(raw)
    job.loader(list(range(64)), batch_size=4)
    job.resume(model=model, optimizer=optimizer)
