"""Per-rank memory of one training step under one disttrain strategy.

Not a user script: a probe for section 4. It builds the benchmark GPT, wraps it
with the strategy in BENCH_STRATEGIES (`strategy[:sharding[:group]]`, e.g.
`fsdp:hybrid:2`; one per launch, so the peak RSS belongs to that strategy) and runs
three forward/backward/AdamW steps:

1. step 1 (untimed) creates the optimizer state;
2. step 2 runs bare; the process's peak resident set (VmHWM) is read after it;
3. step 3 runs under torch's `MemTracker` (torch.distributed._tools.mem_tracker, a
   `TorchDispatchMode` that follows every tensor storage an op creates, with weak
   references that notice when it dies): its peak is the high-water mark of live
   tensor bytes over the whole step, forward, backward, optimizer and zero_grad.
   Model, optimizer and gradient storages alive before the step are registered with
   `track_external`, so the peak includes them.

After step 3, before zero_grad, the old "steady state" count is taken: this rank's
parameters + gradients + optimizer state, per storage (a storage shared by several
tensors, such as a DDP gradient bucket or FSDP's padded shard, counts once and in full).
MemTracker does not see memory a C++ library allocates past the dispatcher (gloo's own
buffers), nor the allocator's slack; RSS shows both.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
from harness import BATCH_SIZE, make_dataset, make_model
from torch.distributed._tools.mem_tracker import MemTracker

import disttrain as dt


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _step(model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)  # as dt.Accumulator does after each step
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()


def measure(spec: str) -> dict:
    parts = spec.split(":")
    strategy, sharding, group = parts[0], (parts[1:2] or ["full"])[0], (parts[2:3] or ["0"])[0]
    rss_base = _status_kib("VmRSS")
    torch.manual_seed(0)
    options: dict[str, Any] = {"sharding": sharding, "shard_group_size": int(group)} if strategy == "fsdp" else {}
    model = dt.wrap(make_model(), strategy=strategy, **options)
    optimizer = dt.make_optimizer(model, torch.optim.AdamW, lr=1e-4)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps a local one
    x, y = (t.clone() for t in make_dataset()[:BATCH_SIZE])  # not views of the whole corpus
    _step(model, optimizer, x, y)
    _step(model, optimizer, x, y)
    rss_peak = _status_kib("VmHWM")
    tracker = MemTracker()
    tracker.track_external(model, optimizer, inner, x, y)
    with tracker:
        _step(model, optimizer, x, y)
    peak = tracker.get_tracker_snapshot("peak")
    snap = peak.get(torch.device("cpu")) or next(iter(peak.values()), {})
    params = list(model.parameters())
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    p, g, o = _storages(params), _storages(q.grad for q in params), _storages(state)
    steady = {"params": sum(p.values()), "grads": sum(g.values()), "optim": sum(o.values())}
    steady["total"] = sum(steady.values())
    return {
        **steady,
        "peak": int(snap.get("Total", 0)),
        "peak_parts": {k: int(v) for k, v in snap.items() if k != "Total"},
        "rss_peak_mib": rss_peak / 1024,
        "rss_base_mib": rss_base / 1024,
    }


def main() -> None:
    spec = os.environ.get("BENCH_STRATEGIES", "ddp")
    with dt.distributed(seed=0) as info:
        out = {spec: measure(spec)}
        Path(os.environ["BENCH_OUT"], f"rank{info.rank}.json").write_text(
            json.dumps(
                {
                    "rank": info.rank,
                    "world": info.world_size,
                    "bytes": out,
                    "step_s": [0.0],
                    "first_step_s": 0.0,
                    "peak_rss_mb": out[spec]["rss_peak_mib"],
                    "tokens_per_step": 0,
                }
            )
        )


if __name__ == "__main__":
    main()
