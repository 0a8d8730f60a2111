"""Worker: a DDP model and a subgroup still referenced (module globals) after
`dt.distributed()` has shut the process group down, as in most user scripts."""

import torch

import disttrain as dt

with dt.distributed(seed=0) as info:
    model = dt.wrap(torch.nn.Linear(16, 16), strategy="ddp")
    group = torch.distributed.new_group(backend="gloo")
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
