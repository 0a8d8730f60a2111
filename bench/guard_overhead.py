"""Overhead of the default guardrails (benchmark, not a test). Issue 6: <= 1% of step time.

    disttrain run --nproc 2 bench/guard_overhead.py [--steps 300] [--out bench/results/guard.md]

Two measurements on the same DDP job (tiny GPT, gloo on CPU, or NCCL on GPUs):
1. Direct cost: the per-step guard calls (heartbeat step + phase marks), the replica
   checksum amortised over `divergence_every` steps, and the watchdog thread's
   heartbeat amortised over its tick, each timed in isolation, as a share of the
   median step time. This is stable on a loaded machine.
2. A/B: alternating blocks of steps with the guard on and off; the difference of the
   median step times. On a shared CPU host this is noisier than the effect itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import disttrain as dt
from disttrain.config import GuardConfig
from disttrain.guard import RunGuard, check_replicas
from disttrain.demo import GPT, GPTConfig
from disttrain.guard.watchdog import Watchdog


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = GuardConfig()
    with dt.distributed(seed=0) as info:
        gcfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128)
        model = dt.wrap(GPT(gcfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        wd = Watchdog(hang_factor=cfg.hang_factor, hang_min_s=cfg.hang_min_s,
                      hang_cap_s=cfg.hang_cap_s, tick_s=cfg.tick_s).start()
        on, off = RunGuard(cfg, wd), RunGuard(GuardConfig(enabled=False))
        g = torch.Generator().manual_seed(info.rank)

        def train_step(guard: RunGuard, n: int) -> float:
            x = torch.randint(0, 256, (8, gcfg.block_size), generator=g).to(info.device)
            t0 = time.perf_counter()
            guard.first_batch(x)
            with guard.phase("forward"):
                _, loss = model(x, x)
            with guard.phase("backward"):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            guard.step(n, model)
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        for n in range(10):  # warm-up
            train_step(off, n)
        times = {"on": [], "off": []}
        n = 10
        while n < 10 + args.steps:
            for name, guard in (("on", on), ("off", off)):
                for _ in range(args.block):
                    n += 1
                    times[name].append(train_step(guard, n))
        step_s = statistics.median(times["off"])

        # 1. Direct costs, each timed alone.
        reps = 20000
        t0 = time.perf_counter()
        for i in range(reps):
            with wd.phase("forward"):
                pass
            with wd.phase("backward"):
                pass
            wd.step(n)
        per_step_calls = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(10):
            check_replicas(model, n)
        replica = (time.perf_counter() - t0) / 10
        t0 = time.perf_counter()
        for _ in range(200):
            wd._beat()
        beat = (time.perf_counter() - t0) / 200
        wd.stop()
        amortised = per_step_calls + replica / cfg.divergence_every + beat * step_s / cfg.tick_s
        ab = statistics.median(times["on"]) / statistics.median(times["off"]) - 1
        if info.is_main:
            lines = [
                "| measure | value |", "|---|---|",
                f"| world size / device | {info.world_size} x {info.device.type} ({info.backend}) |",
                f"| median step, guard off | {step_s * 1e3:.2f} ms |",
                f"| median step, guard on | {statistics.median(times['on']) * 1e3:.2f} ms |",
                f"| per-step calls (step + 2 phases) | {per_step_calls * 1e6:.2f} us |",
                f"| replica checksum (every {cfg.divergence_every} steps) | {replica * 1e3:.2f} ms |",
                f"| heartbeat write (every {cfg.tick_s:g} s, watchdog thread) | {beat * 1e6:.0f} us |",
                f"| **direct overhead, amortised** | **{amortised / step_s * 100:.3f} % of a step** |",
                f"| A/B difference of medians (noisy) | {ab * 100:+.2f} % |",
            ]
            text = "\n".join(lines)
            print(text)
            if args.out:
                Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
