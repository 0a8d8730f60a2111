"""A rank of a 2-rank job that builds the optimizer before `job.wrap()` (test_job.py).

    job_misuse.py OUT STRATEGY    each start appends a line to OUT/starts
"""

import os
import sys
from pathlib import Path

import torch

import disttrain as dt
from disttrain.demo import MLP, MLPConfig

out = Path(sys.argv[1])
with (out / "starts").open("a") as f:
    f.write(f"{os.environ.get('RANK')} {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\n")
with dt.Job(out, strategy=sys.argv[2]) as job:  # FSDP2 replaces the parameters; DDP does not
    raw = MLP(MLPConfig())
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)  # the mistake: before wrap
    model = job.wrap(raw)
    job.loader(list(range(64)), batch_size=4)
    job.resume(model=model, optimizer=optimizer)
