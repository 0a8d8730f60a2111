# issue: https://github.com/pytorch/torchtitan/issues/292
# summary: asked for gradient accumulation on FSDP2: fully_shard has no no_sync() context; FSDP2 moved it to module.set_requires_gradient_sync(is_last_microbatch)
# family: no_sync with FSDP2
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule


def train_step(model: FSDPModule, optimizer, batches, loss_fn):  # sharded in parallelize.py
    for i, (input_ids, labels) in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            loss = loss_fn(model(input_ids), labels) / len(batches)
            loss.backward()
        else:
            with model.no_sync():  # expect: fsdp2-no-sync
                loss = loss_fn(model(input_ids), labels) / len(batches)
                loss.backward()
    optimizer.step()
    optimizer.zero_grad()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
