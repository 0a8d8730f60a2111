"""A rank of a 2-rank job that builds the optimizer before `job.wrap()` (test_job.py).

    job_misuse.py OUT STRATEGY [WHERE]    each start appends a line to OUT/starts

WHERE is `inside` (default: in the `with dt.Job` block, before wrap) or `before` (the
model and optimizer built before `with dt.Job(...)`, so the collector freeze at init
covers them).
"""

import os
import sys
from pathlib import Path

import torch

import disttrain as dt
from disttrain.builtin import MLP, MLPConfig

out, strategy = Path(sys.argv[1]), sys.argv[2]
before = sys.argv[3:] == ["before"]
with (out / "starts").open("a") as f:
    f.write(f"{os.environ.get('RANK')} {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
if before:
    raw = MLP(MLPConfig())
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)  # the mistake: before the job
with dt.Job(out, strategy=strategy) as job:  # FSDP2 replaces the parameters; DDP does not
    if not before:
        raw = MLP(MLPConfig())
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)  # the mistake: before wrap
    model = job.wrap(raw)
    job.loader(list(range(64)), batch_size=4)
    job.resume(model=model, optimizer=optimizer)
