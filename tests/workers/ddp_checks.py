"""Worker: every DDP check of the foundation in one process-group launch.

Each rank writes OUT/rank{r}.json with the measured values; the test asserts.
Reference runs are single-process models computed on each rank from the same seed
on the full global batch, so no second launch is needed.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import disttrain as dt
from disttrain.builtin import GPT, MLP, GPTConfig, MLPConfig

out = Path(sys.argv[1])
results: dict = {}


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=False))


def global_batches(steps, n, shape_fn, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [shape_fn(n, g) for _ in range(steps)]


with dt.distributed(seed=0) as info:
    r, w = info.rank, info.world_size

    # --- parity: N ranks vs one process on the same global batch (SGD, 5 steps) ---
    def parity(make_model, make_batch, per_rank, accum=1):
        torch.manual_seed(0)
        reference = make_model()
        model = dt.wrap(copy.deepcopy(reference), strategy="ddp")
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        acc = dt.Accumulator(model, opt, accum)
        n = per_rank * w * accum
        for x, y in global_batches(5, n, make_batch):
            ref_opt.zero_grad()
            reference(x, y)[1].backward()
            ref_opt.step()
            # rank r takes rows r, r + w, ... of each micro-batch window.
            mine_x, mine_y = x[r::w], y[r::w]
            for m in range(accum):
                sl = slice(m * per_rank, (m + 1) * per_rank)
                with acc.micro_step():
                    acc.backward(model(mine_x[sl], mine_y[sl])[1])
        return max_diff(dt.unwrap(model), reference)

    def mlp_batch(n, g):
        return (torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))

    gpt_cfg = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)

    def gpt_batch(n, g):
        return (torch.randint(0, 256, (n, 16), generator=g),) * 2

    results["parity_mlp"] = parity(lambda: MLP(MLPConfig()), mlp_batch, per_rank=4)
    results["parity_gpt"] = parity(lambda: GPT(gpt_cfg), gpt_batch, per_rank=2)

    # --- accumulation: 4 micro-steps == one step on the 4x batch (both on N ranks) ---
    def accum_vs_big(accum):
        torch.manual_seed(0)
        base = MLP(MLPConfig())
        big = dt.wrap(copy.deepcopy(base), strategy="ddp")
        small = dt.wrap(copy.deepcopy(base), strategy="ddp")
        big_opt = torch.optim.SGD(big.parameters(), lr=0.1)
        small_opt = torch.optim.SGD(small.parameters(), lr=0.1)
        big_acc, small_acc = dt.Accumulator(big, big_opt, 1), dt.Accumulator(small, small_opt, accum)
        calls = {"n": 0}

        def counting_hook(state, bucket):
            calls["n"] += 1
            return allreduce_hook(state, bucket)

        small.register_comm_hook(None, counting_hook)
        per = 3
        for x, y in global_batches(5, per * accum * w, mlp_batch, seed=7):
            mx, my = x[r::w], y[r::w]
            with big_acc.micro_step():
                big_acc.backward(big(mx, my)[1])
            for m in range(accum):
                with small_acc.micro_step():
                    small_acc.backward(small(mx[m * per:(m + 1) * per], my[m * per:(m + 1) * per])[1])
        return max_diff(dt.unwrap(big), dt.unwrap(small)), calls["n"], small_acc.optimizer_steps

    diff, allreduces, steps = accum_vs_big(4)
    results.update(accum_diff=diff, accum_allreduce_calls=allreduces, accum_optimizer_steps=steps)

    # --- a short final window: 3 micro-batches with accum 4, closed by last=True ---
    torch.manual_seed(0)
    base = MLP(MLPConfig())
    ref, short = dt.wrap(copy.deepcopy(base)), dt.wrap(copy.deepcopy(base))
    ref_acc = dt.Accumulator(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 1)
    short_acc = dt.Accumulator(short, torch.optim.SGD(short.parameters(), lr=0.1), 4)
    (x, y), = global_batches(1, 9 * w, mlp_batch, seed=9)
    mx, my = x[r::w], y[r::w]
    with ref_acc.micro_step():
        ref_acc.backward(ref(mx, my)[1])
    for m in range(3):
        with short_acc.micro_step(last=(m == 2)):
            short_acc.backward(short(mx[m * 3:(m + 1) * 3], my[m * 3:(m + 1) * 3])[1])
    results["short_window_diff"] = max_diff(dt.unwrap(ref), dt.unwrap(short))

    # --- global metric with unequal per-rank counts ---
    values = [float(i) for i in range(10 * w)]
    counts = [k + 1 for k in range(w)]  # rank k holds k+1 samples
    start = sum(counts[:r])
    mine = values[start:start + counts[r]]
    tracker = dt.MeanTracker()
    for v in mine:
        tracker.update(v)
    results["global_mean"] = tracker.compute()
    results["global_mean_expected"] = sum(values[:sum(counts)]) / sum(counts)

    # --- accum_steps that differ across ranks: a clear error on every rank ---
    try:
        dt.Accumulator(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 2 if r == 0 else 4)
        results["accum_mismatch"] = None
    except dt.DistributedMismatchError as e:
        results["accum_mismatch"] = str(e)

    # --- an unused parameter: the DDP error comes back with its cause and fixes ---
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x).sum()

    model = dt.wrap(Unused())
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).backward()
        results["unused_error"] = None
    except dt.UserError as e:
        results["unused_error"] = str(e)

    (out / f"rank{r}.json").write_text(json.dumps(results))
