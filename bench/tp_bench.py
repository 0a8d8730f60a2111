"""Tensor parallel x FSDP on 4 gloo ranks of this CPU machine, in one launch:

- disttrain (`dt.wrap(strategy="fsdp", tp=2)`, `dt.Accumulator`) against the same
  plan written by hand with torch (`parallelize_module` with the built-in GPT's plan
  over the 'tp' dimension of a 2 x 2 mesh, `fully_shard` per block and the root over
  'dp', `torch.optim.AdamW`): same model, same batches, same processes; target: at
  most 1.02x; a second torch model built the same way (the control) shows the noise;
- disttrain at tp 1 x dp 4, tp 2 x dp 2 and tp 4 x dp 1: when TP pays on 2 cores;
- `disttrain plan`'s memory per device against what each rank holds: the local
  bytes of its parameters, gradients and optimizer state (DTensor shards), and the
  activations one forward saves for backward (autograd's saved-tensor hooks, each
  storage once, parameters left out); and the activation all-reduces the planner
  counts against those torch runs (`CommDebugMode`).

After two warm-up steps each, the layouts take one optimizer step each in turn (in
a new random order every turn), so every ratio compares steps a second apart; a round is `--steps`
such turns, and each round's ratio is reported to show the noise.
The global batch is the same for every layout: 16 sequences of 64 tokens, each TP
group reading its data-parallel rank's share. fp32, AdamW, no clipping, dropout 0.

    python bench/tp_bench.py [--rounds 5] [--steps 6] [--results bench/results/tp.md]
    python bench/tp_bench.py --render-only      # tp.md again from bench/results/tp.json

Run without torchrun: it launches itself on 4 ranks with one thread each.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.common import base_env, machine  # noqa: E402

WORLD = 4
SEQ = 64
MODEL: dict[str, int | float] = {"block_size": SEQ, "n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0}
GLOBAL_BATCH = 16
LAYOUTS = {
    "torch tp2 x dp2": 2,
    "torch tp2 x dp2 control": 2,
    "disttrain tp2 x dp2": 2,
    "disttrain tp1 x dp4": 1,
    "disttrain tp4 x dp1": 4,
}
"""Name -> TP degree; the data-parallel degree is WORLD / tp. The control is a second,
identical torch model: its ratio to the first is the noise floor of the comparison."""


def launch(args: argparse.Namespace) -> None:
    """Re-run this script under torchrun on WORLD ranks, one thread each."""
    env = base_env(threads=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [__file__, "--rounds", str(args.rounds), "--steps", str(args.steps), "--results", str(args.results)]
    proc = subprocess.run(cmd, env=env, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"tp_bench failed (exit {proc.returncode})")


def by_hand(model, mesh):
    """The 2D plan written with torch alone: TP over mesh['tp'], then FSDP over mesh['dp']."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for i in range(len(model.blocks)):
        plan.update({k.replace("*", str(i)): styles[v]() for k, v in model.tp_plan.items()})
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


class Runner:
    """One layout: its model, optimizer and step; `step(batches)` trains one batch."""

    def __init__(self, name: str, tp: int, base, mesh):
        import torch

        import disttrain as dt

        self.name, self.tp, self.dp = name, tp, WORLD // tp
        self.model = copy.deepcopy(base)
        self.opt: torch.optim.Optimizer
        if name.startswith("torch"):
            self.model = by_hand(self.model, mesh)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
            self.acc = None
        else:
            self.model = dt.wrap(self.model, strategy="fsdp", tp=tp)
            self.opt = dt.make_optimizer(self.model, torch.optim.AdamW, lr=3e-4)
            self.acc = dt.Accumulator(self.model, self.opt, accum_steps=1)
        self.times: list[list[float]] = []

    def step(self, batch) -> None:
        import torch.distributed as dist

        x = batch[dist.get_rank() // self.tp :: self.dp]  # this TP group's share
        if self.acc is None:
            self.model(x, x)[1].backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        with self.acc.micro_step():
            self.acc.backward(self.model(x, x)[1])

    def timed(self, batch) -> float:
        """Seconds of one step on `batch`, the ranks starting together."""
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        self.step(batch)
        return time.perf_counter() - t0


def local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, a DTensor by its local shard."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def saved_activation_bytes(runner: Runner, batch) -> int:
    """Bytes autograd saves for backward in one forward, parameters (and views of them)
    left out: each module's own parameters are known while it runs."""
    import torch

    params: set[int] = set()
    saved: dict[int, int] = {}

    def ptrs(module) -> set[int]:
        return {local_ptr(p) for p in module.parameters(recurse=False)}

    def local_ptr(t) -> int:
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()

    def pack(t):
        with torch.no_grad():
            local = t.to_local() if hasattr(t, "to_local") else t
            s = local.untyped_storage()
            if s.data_ptr() not in params:
                saved[s.data_ptr()] = s.nbytes()
        return t

    hooks = []
    for m in runner.model.modules():
        hooks.append(m.register_forward_pre_hook(lambda m, a: params.update(ptrs(m))))
        hooks.append(m.register_forward_hook(lambda m, a, o: params.difference_update(ptrs(m))))
    import torch.distributed as dist

    x = batch[dist.get_rank() // runner.tp :: runner.dp]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = runner.model(x, x)[1]
    for h in hooks:
        h.remove()
    loss.backward()
    runner.opt.step()
    runner.opt.zero_grad(set_to_none=True)
    return sum(saved.values())


def measure_memory(runner: Runner, batch) -> dict[str, int]:
    """This rank's bytes: parameters, gradients (after backward), optimizer state, activations."""
    import torch.distributed as dist

    acts = saved_activation_bytes(runner, batch)
    x = batch[dist.get_rank() // runner.tp :: runner.dp]
    runner.model(x, x)[1].backward()
    params = list(runner.model.parameters())
    grads = local_bytes(p.grad for p in params)
    runner.opt.step()
    state = runner.opt.state.values()
    optim = local_bytes(v for per_param in state for v in per_param.values() if hasattr(v, "untyped_storage"))
    runner.opt.zero_grad(set_to_none=True)
    return {"params": local_bytes(params), "grads": grads, "optim": optim, "activations": acts}


def count_all_reduces(runner: Runner, batch) -> dict[str, int]:
    """All-reduces in one forward and one backward, as torch's CommDebugMode counts them."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    x = batch[dist.get_rank() // runner.tp :: runner.dp]
    out = {}
    with CommDebugMode() as fwd:
        loss = runner.model(x, x)[1]
    with CommDebugMode() as bwd:
        loss.backward()
    runner.opt.zero_grad(set_to_none=True)
    for phase, mode in (("fwd", fwd), ("bwd", bwd)):
        out[phase] = sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))
    return out


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import disttrain as dt
    from disttrain.builtin import GPT, GPTConfig

    torch.set_num_threads(1)
    with dt.distributed(seed=0):
        mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        base = GPT(GPTConfig(**MODEL))  # type: ignore[arg-type]
        runners = [Runner(name, tp, base, mesh) for name, tp in LAYOUTS.items()]
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(8)]
        for runner in runners:  # warm-up: two steps each
            for b in batches[:2]:
                runner.step(b)
        order = random.Random(0)  # the same on every rank
        for _ in range(args.rounds):
            for ru in runners:
                ru.times.append([])
            for step in range(args.steps):  # one step of each layout, in a new order each turn
                # (shuffled, not rotated: no layout always follows the same one)
                for ru in order.sample(runners, len(runners)):
                    ru.times[-1].append(ru.timed(batches[step % len(batches)]))
        memory = {ru.name: measure_memory(ru, batches[0]) for ru in runners}
        comms = {ru.name: count_all_reduces(ru, batches[0]) for ru in runners}
        every: list = [None] * WORLD
        dist.all_gather_object(every, memory)
        if dist.get_rank() == 0:
            data = {"times": {ru.name: ru.times for ru in runners}, "memory": every, "comms": comms}
            write(args, data)


def write(args: argparse.Namespace, data: dict) -> None:
    """Render tp.md from the run's data, which is kept beside it in tp.json
    (`--render-only` renders it again)."""
    from bench.tp_report import render

    data.setdefault("command", f"python bench/tp_bench.py --rounds {args.rounds} --steps {args.steps}")
    data.setdefault("machine", machine())
    text = render(data, model=MODEL, world=WORLD, global_batch=GLOBAL_BATCH, layouts=LAYOUTS)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(text)
    args.results.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each layout per round")
    ap.add_argument("--results", type=Path, default=BENCH / "results" / "tp.md")
    ap.add_argument("--render-only", action="store_true", help="render tp.md again from tp.json beside it")
    args = ap.parse_args()
    if args.render_only:
        write(args, json.loads(args.results.with_suffix(".json").read_text()))
    elif "RANK" in os.environ:
        rank_main(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
