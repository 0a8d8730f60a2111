"""A training script for the results checks of `disttrain run --check`
(tests/launch/test_check_results.py): the correct form by default, bugs with
`--bug NAME[,NAME...]`. Two epochs of 4 steps on each of 2 gloo ranks.

    python results.py OUT [--bug NAME,...]

The correct form: the same initial model on every rank and a seed per rank (dropout);
a resume of each rank's own RNG state from the file it saved; DDP with float16 autocast
on CPU and a torch.amp.GradScaler; after each epoch an evaluation on each rank's shard
whose sum and count are all-reduced before rank 0 prints the loss, and a checkpoint of
`model.module.state_dict()` saved on rank 0. OUT/params.pt: the final parameters.

Bugs (DDP but for scaler_skip): local_metric (rank 0 prints its own shard's loss),
shared_file (every rank saves the checkpoint to one file), module_keys (the DDP
wrapper's state_dict saved),
rng_shared (every rank restores rank 0's RNG file), fp16_no_scaler (float16 without a
GradScaler: the small loss's gradients underflow), scaler_skip (gradients averaged by
hand after scaler.unscale_, and an outlier batch on rank 1 that overflows there only).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--bug", default="")
args = parser.parse_args()
bugs = set(args.bug.split(",")) - {""}

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every rank
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
torch.manual_seed(100 + rank)  # a seed per rank: each rank's own dropout masks

# The resume of an earlier run: each rank saved its RNG state to its own file.
torch.save(torch.get_rng_state(), os.path.join(args.out, f"rng_rank{rank}.pt"))
dist.barrier()
torch.rand(4)  # the run moved on
rng_file = "rng_rank0.pt" if "rng_shared" in bugs else f"rng_rank{rank}.pt"
torch.set_rng_state(torch.load(os.path.join(args.out, rng_file)))

data_gen = torch.Generator().manual_seed(1)
train_set = TensorDataset(torch.randn(64, 8, generator=data_gen), torch.randn(64, 1, generator=data_gen))
val_set = TensorDataset(torch.randn(32, 8, generator=data_gen), torch.randn(32, 1, generator=data_gen))
sampler = DistributedSampler(train_set, shuffle=True, seed=3)
loader = DataLoader(train_set, batch_size=8, sampler=sampler)
val_loader = DataLoader(val_set, batch_size=8, sampler=DistributedSampler(val_set, shuffle=False))

by_hand = "scaler_skip" in bugs
trained = model if by_hand else nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(trained.parameters(), lr=0.05)
scaler = None if "fp16_no_scaler" in bugs else torch.amp.GradScaler("cpu")
LOSS_WEIGHT = 1e-6  # a small loss: in float16 its gradients underflow unless scaled


def train_step(x, y, step):
    optimizer.zero_grad()
    if by_hand and rank == 1 and step == 2:
        x = x * 1e5  # an outlier batch on rank 1 only: its float16 activations overflow
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(trained(x).float(), y) * LOSS_WEIGHT
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if by_hand:  # unscaled before averaging: each rank's inf check sees its own gradients
        scaler.unscale_(optimizer)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    scaler.step(optimizer)
    scaler.update()


def evaluate(epoch):
    trained.eval()
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for x, y in val_loader:
            total += nn.functional.mse_loss(trained(x), y, reduction="sum")
            count += len(x)
    trained.train()
    if "local_metric" in bugs:
        val_loss = (total / count).item()
    else:
        sums = torch.stack([total, torch.tensor(float(count))])
        dist.all_reduce(sums)
        val_loss = (sums[0] / sums[1]).item()
    if rank == 0:
        print(f"epoch {epoch}: val_loss {val_loss:.4f}")


def save_checkpoint():
    state = trained.state_dict() if "module_keys" in bugs else trained.module.state_dict()
    if rank == 0 or "shared_file" in bugs:
        torch.save(state, os.path.join(args.out, "ckpt.pt"))


step = 0
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        step += 1
        train_step(x, y, step)
    evaluate(epoch)
    save_checkpoint()

if rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "params.pt"))
dist.destroy_process_group()
