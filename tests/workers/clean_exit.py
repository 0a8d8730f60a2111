"""A correct script that frees its distributed objects at exit in the ways that hung a
warm worker (tests/launch/test_clean_exit.py): `clean_exit.py VARIANT`.

- ddp: a DDP forward and backward, the script's own destroy_process_group(), then
  main() returns (the DDP model, which holds the destroyed group, is freed there);
- fsdp: the same with FSDP2's fully_shard;
- loader: a few steps from a DataLoader with two workers, then the same;
- exit0: the ddp variant ending in sys.exit(0) after the destroy;
- thread: a non-daemon thread that never ends, left running after the last line.
Each rank prints "last line" last.
"""

import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(variant: str) -> None:
    dist.init_process_group("gloo")
    if variant == "thread":
        dist.destroy_process_group()
        threading.Thread(target=time.sleep, args=(3600,)).start()
        print("last line", flush=True)
        return
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model = fully_shard(model) if variant == "fsdp" else DDP(model)
    batches = [torch.randn(2, 4)]
    if variant == "loader":
        data = TensorDataset(torch.randn(32, 4))
        batches = [x for (x,) in DataLoader(data, batch_size=4, sampler=DistributedSampler(data), num_workers=2)]
    for x in batches:
        model(x).sum().backward()
    dist.destroy_process_group()
    print("last line", flush=True)
    if variant == "exit0":
        sys.exit(0)


main(sys.argv[1])
