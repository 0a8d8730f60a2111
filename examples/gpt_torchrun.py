"""A small GPT trained on a token file with plain torchrun and DDP: the script as a
user has it before disttrain. examples/gpt_job.py is the same training on `dt.Job`.

    python examples/gpt_torchrun.py --make-data                  # data/stdlib/{train,val}.bin
    torchrun --nproc-per-node 2 examples/gpt_torchrun.py         # or: disttrain run --nproc 2 ...

The token files are nanoGPT's raw format: uint16 tokens, no header. `--make-data`
writes the bytes of the Python standard library's own .py files (one token per byte,
every tenth file held out into val.bin), so nothing is downloaded. A second start
resumes from out/ckpt.pt: the weights, the optimizer and the step, but not the data
position (the epoch restarts), and a kill during the save loses the checkpoint.
"""

import argparse
import math
import os
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from disttrain.builtin import GPT, GPTConfig


def make_data(folder: str, max_bytes: int) -> None:
    """train.bin and val.bin: the stdlib's .py files as byte tokens, every tenth file held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    size = 0
    for i, path in enumerate(files):
        if size >= max_bytes:
            break
        text = path.read_bytes()
        parts["val" if i % 10 == 9 else "train"].append(text)
        size += len(text)
    Path(folder).mkdir(parents=True, exist_ok=True)
    for split, texts in parts.items():
        np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.uint16).tofile(f"{folder}/{split}.bin")
        print(f"{folder}/{split}.bin: {sum(map(len, texts)):,} tokens")


class TokenFile(Dataset):
    """Non-overlapping windows of a uint16 token file: sample i is (x, y), y shifted by one."""

    def __init__(self, path: str, block_size: int):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int):
        start = i * self.block_size
        window = torch.from_numpy(self.tokens[start:start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def lr_lambda(args):
    """The factor on the base learning rate: linear warmup, then a cosine down to 10%."""
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def batches(loader, sampler, device):
    """Micro-batches forever; the sampler's epoch set before each pass, else every epoch
    repeats the first one's order."""
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device), y.to(device)
        epoch += 1


@torch.no_grad()
def evaluate(model, loader, device, max_batches: int, ddp: bool) -> float:
    """Mean loss over this rank's share of the eval set, then over all ranks."""
    model.eval()
    total = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        _, loss = model(x.to(device), y.to(device))
        total += torch.stack([loss * len(x), torch.tensor(len(x), device=device)])
    if ddp:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main(args) -> None:
    ddp = "RANK" in os.environ  # started by torchrun
    if ddp:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
    else:
        rank, world, device = 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    master = rank == 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    out = Path(args.out)
    if master:
        out.mkdir(parents=True, exist_ok=True)

    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    step = 0
    if (out / "ckpt.pt").exists():
        ckpt = torch.load(out / "ckpt.pt", map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step = ckpt["step"]
        if master:
            print(f"resumed from {out / 'ckpt.pt'} at step {step}")
    raw = model
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    train_set = TokenFile(f"{args.data}/train.bin", args.block_size)
    val_set = TokenFile(f"{args.data}/val.bin", args.block_size)
    sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None,
                        drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False) if ddp else None
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler)
    data = batches(loader, sampler, device)

    t0 = time.time()
    while step < args.steps:
        for micro in range(args.accum):
            # Gradients are all-reduced on the window's last micro-batch only.
            sync = not ddp or micro == args.accum - 1
            with nullcontext() if sync else model.no_sync():
                x, y = next(data)
                _, loss = model(x, y)
                (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if master and step % args.log_every == 0:
            tokens = args.log_every * args.accum * args.batch_size * args.block_size * world
            print(f"step {step}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.2e}, "
                  f"{tokens / (time.time() - t0):,.0f} tokens/s")
            t0 = time.time()
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate(model, val_loader, device, args.eval_batches, ddp)
            if master:
                print(f"step {step}: val loss {val_loss:.4f}")
        if master and (step % args.ckpt_every == 0 or step == args.steps):
            torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step}, out / "ckpt.pt")
    if master:
        print(f"done at step {step}; checkpoint in {out / 'ckpt.pt'}")
    if ddp:
        dist.barrier()  # every rank is done with the group before any takes it down
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a small GPT on a token file")
    ap.add_argument("--make-data", action="store_true", help="write DATA/{train,val}.bin and exit")
    ap.add_argument("--data-bytes", type=int, default=4_000_000, help="--make-data's token budget")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--out", default="runs/gpt_torchrun")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=100)
    a = ap.parse_args()
    if a.make_data:
        make_data(a.data, a.data_bytes)
    else:
        main(a)
