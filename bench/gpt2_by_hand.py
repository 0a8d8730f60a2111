"""The GPT-2 124M training step of bench/gpt2_bench.py written by hand: a plain torch
DDP or FSDP2 loop, the reference that `disttrain train`'s step time is compared with.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/gpt2_by_hand.py --strategy ddp \\
        --tokens DIR --steps 6 --block 256 --out RESULT.json [--compile] [--memory]

The same work as `disttrain train examples/gpt2_124m.toml` with the bench's overrides:
the model from disttrain's GPT builder (`disttrain.builtin.GPT`, the [model] shape of the
example, `--block` tokens), the same token windows (`disttrain.data.token_files`, 5%
held out), one sequence per rank and step, AdamW with the example's lr, betas, weight
decay on matrices only and grad clipping, a warmup-cosine LambdaLR, non-reentrant
activation checkpointing per block (torch.utils.checkpoint), with `--compile`
`nn.Module.compile` per block after checkpointing and before sharding, then DDP (25 MB
buckets, gradients as bucket views) or FSDP2 `fully_shard` per block and the root,
on gloo. Nothing else: no guard, no sampler commits, no metrics records, no checkpoint.

Measured per step on every rank: the wall time from the end of the previous step to
the end of this one (as `disttrain train`'s step_time_s counts it: data, forward,
backward, clip, optimizer step, zero_grad, the loss read back), and its phases. With
`--memory`, one more step after the timed ones under torch's profiler (profile_memory):
the bytes of parameters, gradients and optimizer state on this rank (local shards,
each storage once, counted at the end of backward) and how far the profiler's curve of
CPU allocations rose above that state during forward + backward and during the
optimizer step. Rank 0 writes RESULT.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import tomllib
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "gpt2_124m.toml"
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from disttrain.builtin import GPT  # noqa: E402
from disttrain.config.gpt_shape import GPTConfig  # noqa: E402
from disttrain.data.token_files import token_datasets  # noqa: E402


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def build(args, cfg: dict, world: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """Model (AC, compile, DDP or FSDP2), AdamW and its schedule, in torchtitan's order."""
    torch.manual_seed(0)
    shape = dict(kv.split("=") for kv in args.shape.split(",") if kv)
    model = GPT(GPTConfig(**{**cfg["model"], **{k: int(v) for k, v in shape.items()}, "block_size": args.block}))
    ndims = {n: p.dim() for n, p in model.named_parameters()}
    blocks = []
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Checkpointed(block) if args.ac else block
        blocks.append(model.blocks[i])
    if args.compile:
        for block in blocks:
            block.compile()
    wrapped: nn.Module = model  # FSDP2 shards in place
    if args.strategy == "ddp":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=25.0, gradient_as_bucket_view=True)
        named = list(model.named_parameters())  # (the wrapper's .module)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        named = list(model.named_parameters())
    o = cfg["optim"]
    key = (lambda n: n.replace(".block.", ".")) if args.ac else (lambda n: n)
    decay = [p for n, p in named if ndims[key(n)] >= 2]
    rest = [p for n, p in named if ndims[key(n)] < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
        lr=o["lr"],
        betas=tuple(o["betas"]),
    )
    total, warm = args.steps + 1, max(1, round(0.05 * (args.steps + 1)))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return wrapped, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def one_step(model, opt, sched, batch, grad_clip: float, profile=None) -> dict:
    """Forward, backward, clip, step, zero; the phase times (s). `profile` (memory
    runs): a context factory entered around forward + backward and around the rest."""
    x, y = batch
    whole = profile or contextlib.nullcontext
    t = [time.perf_counter()]
    with whole() as fwd_bwd:
        loss = model(x, y)[1]
        t.append(time.perf_counter())
        loss.backward()
    t.append(time.perf_counter())
    state = (
        {
            "params": storage_bytes(model.parameters()),
            "grads": storage_bytes(p.grad for p in model.parameters()),
            "optim": storage_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        }
        if profile
        else {}
    )
    with whole() as rest:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        t.append(time.perf_counter())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    value = loss.item()
    t.append(time.perf_counter())
    out = {
        "loss": value,
        "forward": t[1] - t[0],
        "backward": t[2] - t[1],
        "clip": t[3] - t[2],
        "optimizer": t[4] - t[3],
    }
    return {**out, "state": state, "profiles": (fwd_bwd, rest)} if profile else out


def curve(prof) -> tuple[int, int]:
    """(highest, last) level of the allocation curve of a profile: every CPU allocation
    and free the profiler recorded (profile_memory), in time order, summed from 0 at
    its start."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    level, top = 0, 0
    for _, nbytes in events:
        level += nbytes
        top = max(top, level)
    return top, level


def measure_memory(model, opt, sched, batch, grad_clip: float) -> dict:
    """One step under torch's profiler with profile_memory (see the module doc). At the
    end of backward the live tensors are the state (counted); the forward + backward
    peak is that state plus how far the allocation curve rose above its end level; the
    optimizer phase (clip, step, zero_grad) starts from the state."""
    acts = [torch.profiler.ProfilerActivity.CPU]

    def profile():
        return torch.profiler.profile(activities=acts, profile_memory=True)

    step = one_step(model, opt, sched, batch, grad_clip, profile)
    (top, end), (opt_top, _) = (curve(p) for p in step["profiles"])
    st = step["state"]
    state = st["params"] + st["grads"] + st["optim"]
    return {
        **st,
        "state": state,
        "peak_fwd_bwd": state + top - end,
        "above_state_fwd_bwd": top - end,
        "peak_optimizer": state + opt_top,
        "peak_rss_mb": peak_rss_mb(),
    }


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--tokens", required=True, help="a folder written by `disttrain data prepare`")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="", help="model overrides for a smoke run, e.g. n_layer=2,n_embd=64")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-ac", dest="ac", action="store_false", help="no activation checkpointing")
    ap.add_argument("--memory", action="store_true", help="one more step, profiled (not timed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = tomllib.loads(CONFIG.read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched = build(args, cfg, world)
    train, _, _ = token_datasets(args.tokens, args.block, heldout_fraction=cfg["data"]["heldout_fraction"])
    sampler: DistributedSampler[int] = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = iter(DataLoader(train, batch_size=args.batch, sampler=sampler, drop_last=True))
    clip = cfg["optim"]["grad_clip"]
    laps, phases, last = [], [], time.perf_counter()
    for _ in range(args.steps):
        phases.append(one_step(model, opt, sched, next(loader), clip))
        now = time.perf_counter()
        laps.append(now - last)
        last = now
    memory = measure_memory(model, opt, sched, next(loader), clip) if args.memory else None
    every: list[dict] = [{}] * world  # (all_gather_object fills every entry)
    dist.all_gather_object(
        every, {"laps": laps, "phases": phases, "memory": memory, "threads": torch.get_num_threads()}
    )
    if rank == 0:
        result = {
            "strategy": args.strategy,
            "compile": args.compile,
            "block": args.block,
            "world": world,
            "step_time_s": [list(t) for t in zip(*(e["laps"] for e in every), strict=False)],
            "step_time_max_s": [max(t) for t in zip(*(e["laps"] for e in every), strict=False)],
            "phases_rank0": every[0]["phases"],
            "memory": [e["memory"] for e in every],
            "threads": [e["threads"] for e in every],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    # Not a normal exit: freeing DDP's reducer at interpreter exit joins gloo's threads
    # while holding the GIL one of them waits for (a hang seen at w=2).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
