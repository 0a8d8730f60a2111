# issue: https://github.com/huggingface/accelerate/pull/3762
# summary: fix: an FSDP2 module (FSDPModule) has no no_sync(); gradient synchronization is turned off with model.set_requires_gradient_sync(False)
# family: no_sync with FSDP2
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

GRAD_ACCUM = 8


def train(model, optimizer, loader):
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    for step, (x, y) in enumerate(loader):
        last = (step + 1) % GRAD_ACCUM == 0
        ctx = contextlib.nullcontext() if last else model.no_sync()  # expect: fsdp2-no-sync
        with ctx:
            loss = torch.nn.functional.cross_entropy(model(x), y) / GRAD_ACCUM
            loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
