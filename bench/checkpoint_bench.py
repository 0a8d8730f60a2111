"""Checkpoint benchmark (not a test): save/load throughput against a raw sequential
write/read of the same number of bytes on the same disk, and the training stall of
an async save against a synchronous one.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        bench/checkpoint_bench.py --dir CKPT_DIR [--layers 6 --width 384]

Rank 0 writes the Markdown table to bench/results/checkpoint.md (or --results).
Every number is the median of --repeat runs. Reads may be served from the page
cache for both DCP and the raw baseline (the same conditions for both).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import disttrain as dt
from disttrain.checkpoint import Checkpointer, TrainState
from disttrain.demo import GPT, GPTConfig


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def raw_write_read(path: Path, nbytes: int) -> tuple[float, float]:
    """Seconds to write `nbytes` sequentially (4 MiB chunks, fsync) and read them back."""
    chunk = os.urandom(1 << 22)
    barrier()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    barrier()
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass
    barrier()
    t_read = time.perf_counter() - t0
    path.unlink()
    return t_write, t_read


def train_step(state: TrainState, batch: torch.Tensor) -> None:
    _, loss = state.model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results" / "checkpoint.md"))
    args = ap.parse_args()
    root = Path(args.dir)
    with dt.distributed(seed=0) as info:
        cfg = GPTConfig(block_size=64, n_layer=args.layers, n_head=6, n_embd=args.width)
        model = dt.wrap(GPT(cfg), strategy="ddp")
        state = TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
        batch = torch.randint(0, 256, (4, cfg.block_size + 1))
        train_step(state, batch)  # optimizer state exists
        n_params = sum(p.numel() for p in model.parameters())
        rows = {}
        for mode in ("off", "thread"):
            if info.is_main:
                shutil.rmtree(root / mode, ignore_errors=True)
            barrier()
            ck = Checkpointer(root / mode, keep_last=1, async_mode=mode)
            saves, stalls, loads, steps = [], [], [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                train_step(state, batch)
                steps.append(time.perf_counter() - t0)
                barrier()
                t0 = time.perf_counter()
                ck.save(state)
                stalls.append(time.perf_counter() - t0)  # the loop is blocked this long
                ck.wait()
                barrier()
                saves.append(time.perf_counter() - t0)  # until committed
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ck.load(state)
                barrier()
                loads.append(time.perf_counter() - t0)
            ck.close()
            rows[mode] = dict(save=statistics.median(saves), stall=statistics.median(stalls),
                              load=statistics.median(loads), step=statistics.median(steps),
                              nbytes=dir_bytes(ck.last_saved))
        nbytes = rows["off"]["nbytes"]
        share = nbytes // info.world_size
        raw = [raw_write_read(root / f"raw-{info.rank}.bin", share) for _ in range(args.repeat)]
        raw_w = statistics.median(r[0] for r in raw)
        raw_r = statistics.median(r[1] for r in raw)
        if info.is_main:
            gb = nbytes / 1e9
            lines = [
                "## Checkpoint save/load (disttrain.checkpoint, DCP, gloo, CPU)",
                "",
                f"Command: `python -m torch.distributed.run --standalone --nproc-per-node="
                f"{info.world_size} bench/checkpoint_bench.py --dir CKPT_DIR --layers {args.layers} "
                f"--width {args.width}`",
                "",
                f"GPT {n_params / 1e6:.1f}M parameters + AdamW state, DDP at world size "
                f"{info.world_size}; checkpoint {nbytes / 1e6:.1f} MB on disk; torch "
                f"{torch.__version__}; median of {args.repeat}.",
                "",
                "| measurement | seconds | GB/s |",
                "|---|---:|---:|",
                f"| raw sequential write + fsync (same bytes, same disk) | {raw_w:.3f} | {gb / raw_w:.2f} |",
                f"| checkpoint save, sync (shards + sha256 manifest + commit) | {rows['off']['save']:.3f} "
                f"| {gb / rows['off']['save']:.2f} |",
                f"| checkpoint save, async thread, until committed | {rows['thread']['save']:.3f} "
                f"| {gb / rows['thread']['save']:.2f} |",
                f"| raw sequential read (same bytes) | {raw_r:.3f} | {gb / raw_r:.2f} |",
                f"| checkpoint load (verify sha256 + DCP load) | {rows['off']['load']:.3f} "
                f"| {gb / rows['off']['load']:.2f} |",
                "",
                "| training stall per save | seconds | x one train step |",
                "|---|---:|---:|",
                f"| sync save | {rows['off']['stall']:.3f} | {rows['off']['stall'] / rows['off']['step']:.1f} |",
                f"| async save (thread): staging copy only | {rows['thread']['stall']:.3f} "
                f"| {rows['thread']['stall'] / rows['off']['step']:.1f} |",
                "",
            ]
            out = Path(args.results)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("\n".join(lines))
            print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
