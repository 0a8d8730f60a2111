# issue: https://github.com/pytorch/pytorch/issues/163519
# summary: asks whether fully_shard (FSDP2) mixed precision still needs amp's GradScaler (as torchtitan#1735 does): with fp16 parameters it does, and the plain scaler handles DTensor gradients
# family: GradScaler and FSDP
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.half))  # expect: fsdp2-fp16-without-scaler
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(10):
    x = torch.randn(8, 1024, device="cuda")
    loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
