# issue: https://github.com/pytorch/torchtitan/issues/1735
# summary: with FSDP2 and MixedPrecisionPolicy(param_dtype=float16) the backward runs in fp16 and can underflow; a loss scaler is still needed (torch.amp.GradScaler accepts FSDP2's DTensor gradients)
# family: GradScaler and FSDP
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def build(model):
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)  # expect: fsdp2-fp16-without-scaler
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def step(model, optimizer, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
