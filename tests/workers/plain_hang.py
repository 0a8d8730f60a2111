"""A plain DDP script (no dt.Job) in which one rank stops making progress in its own
code: `python plain_hang.py STUCK_RANK`. The other ranks wait in the backward's
gradient all-reduce; the script watchdog of `disttrain run` must name STUCK_RANK."""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def wait_for_a_lock_that_never_comes() -> None:
    time.sleep(3600)


def main() -> None:
    stuck = int(sys.argv[1])
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        if step == 3 and dist.get_rank() == stuck:
            wait_for_a_lock_that_never_comes()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
