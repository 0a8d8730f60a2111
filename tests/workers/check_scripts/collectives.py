"""Collectives for `disttrain run --check` (tests/launch/test_check_collectives.py): the
correct form by default, one bug with `--bug NAME`. Plain torch on gloo, 2 ranks: a
small model whose gradients are averaged by hand for 4 steps, then one call of every
collective kind the checks compare.

    python collectives.py [--bug one_rank|shapes|early_exit]

Bugs: one_rank (the loss is all-reduced on rank 0 only, to print it), shapes (a count
tensor whose size depends on the rank), early_exit (rank 1 exits before the final
evaluation's all_reduce).
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--bug", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
model = nn.Linear(4, 1)
for p in model.parameters():
    dist.broadcast(p.data, src=0)  # rank 0's initial weights everywhere
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1 + rank)

for _ in range(4):
    x, y = torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    if args.bug == "one_rank" and rank == 0:
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)  # the bug: rank 1 never joins
    optimizer.step()

counts = torch.ones(3 + rank if args.bug == "shapes" else 3)
dist.all_reduce(counts, op=dist.ReduceOp.MAX)

if args.bug == "early_exit" and rank == 1:
    sys.exit(0)  # the bug: rank 0 still evaluates below
total = torch.tensor([float(rank)])
dist.all_reduce(total)

# one call of each kind more; shapes the same on every rank, but what differs by design
gathered = [torch.zeros(2) for _ in range(world)]
dist.all_gather(gathered, torch.full((2,), float(rank)))
flat, part = torch.zeros(2 * world), torch.zeros(2)
single = hasattr(dist, "all_gather_single")  # torch 2.13's names of all_gather_into_tensor, ...
(dist.all_gather_single if single else dist.all_gather_into_tensor)(flat, torch.full((2,), float(rank)))
(dist.reduce_scatter_single if single else dist.reduce_scatter_tensor)(part, torch.arange(2.0 * world))
dist.reduce(part, dst=0)
dist.gather(part, [torch.zeros(2) for _ in range(world)] if rank == 0 else None, dst=0)
dist.scatter(part, [torch.ones(2) for _ in range(world)] if rank == 0 else None, src=0)
sent, received = [1 + rank] * world, [1 + r for r in range(world)]  # rank r sends r + 1 to each
out = torch.zeros(sum(received))
dist.all_to_all_single(out, torch.ones(sum(sent)), output_split_sizes=received, input_split_sizes=sent)
if rank == 0:  # the same broadcast from two lines: correct
    dist.broadcast(part, src=0)
else:
    dist.broadcast(part, src=0)
names = [None] * world
dist.all_gather_object(names, f"rank{rank}")
settings = [{"lr": 0.1}] if rank == 0 else [None]
dist.broadcast_object_list(settings, src=0)
pair = dist.new_group(list(range(world)))
dist.all_reduce(part, group=pair)
dist.barrier()
dist.destroy_process_group()
