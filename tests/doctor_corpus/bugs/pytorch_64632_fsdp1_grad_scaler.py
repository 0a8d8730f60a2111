# issue: https://github.com/pytorch/pytorch/issues/64632
# summary: FSDP (FullyShardedDataParallel) needs a sharded grad scaler: each rank's plain GradScaler sees only its own gradient shard, so ranks disagree on skipping a step
# family: GradScaler and FSDP
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = FSDP(torch.nn.Linear(1024, 1024).cuda())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.cuda.amp.GradScaler()  # expect: gradscaler-unsynced
for _ in range(10):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(8, 1024, device="cuda")).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
