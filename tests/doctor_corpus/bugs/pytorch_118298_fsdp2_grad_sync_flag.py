# issue: https://github.com/pytorch/pytorch/pull/118298
# summary: FSDP2 replaces no_sync() with set_requires_gradient_sync(); DDP's require_backward_grad_sync flag set on a fully_shard module is never read, so every micro-step still reduce-scatters
# family: no_sync with FSDP2
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def train(model, optimizer, loader, accum):
    fully_shard(model)
    for step, (x, y) in enumerate(loader):
        is_last_microbatch = (step + 1) % accum == 0
        model.require_backward_grad_sync = is_last_microbatch  # expect: fsdp2-no-sync
        (torch.nn.functional.mse_loss(model(x), y) / accum).backward()
        if is_last_microbatch:
            optimizer.step()
            optimizer.zero_grad()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
