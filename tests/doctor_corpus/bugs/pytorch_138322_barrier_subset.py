# issue: https://github.com/pytorch/pytorch/issues/138322
# summary: `if rank != 3: barrier()` then a second barrier: rank 3 calls one barrier, the others two, so ranks pair up wrongly and rank 0 hangs until the timeout
# family: collective under a rank guard
import os
from datetime import timedelta

import torch

rank = int(os.getenv("RANK", "0"))
torch.distributed.init_process_group("nccl", timeout=timedelta(minutes=1))

if rank != 3:
    torch.distributed.barrier()  # expect: collective-under-rank-guard

torch.distributed.barrier()

print(f"{rank} Done.")
