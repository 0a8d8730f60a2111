"""Per-rank tensor bytes under each disttrain strategy after one optimizer step.

Not a user script: a probe for section 4. It builds the benchmark GPT once per
strategy, runs one forward, backward and AdamW step, and, before zeroing the
gradients, counts this rank's parameters, gradients and optimizer state. Bytes
are counted per storage (a storage shared by several tensors, such as a DDP
gradient bucket or FSDP's padded shard, counts once and in full).

BENCH_STRATEGIES: comma-separated `strategy[:sharding[:group]]`, e.g. `fsdp:hybrid:2`.
"""

import json
import os
from pathlib import Path

import torch

import disttrain as dt
from harness import BATCH_SIZE, make_dataset, make_model


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def measure(spec: str) -> dict:
    parts = spec.split(":")
    strategy, sharding, group = parts[0], (parts[1:2] or ["full"])[0], (parts[2:3] or ["0"])[0]
    torch.manual_seed(0)
    options = {"sharding": sharding, "shard_group_size": int(group)} if strategy == "fsdp" else {}
    model = dt.wrap(make_model(), strategy=strategy, **options)
    optimizer = dt.make_optimizer(model, torch.optim.AdamW, lr=1e-4)
    x, y = make_dataset()[:BATCH_SIZE]
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps a local one
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    p, g, o = _storages(params), _storages(p.grad for p in params), _storages(state)
    result = {"params": sum(p.values()), "grads": sum(g.values()), "optim": sum(o.values())}
    result["total"] = sum(result.values())
    optimizer.zero_grad(set_to_none=True)
    return result


def main() -> None:
    specs = os.environ.get("BENCH_STRATEGIES", "ddp").split(",")
    with dt.distributed(seed=0) as info:
        out = {spec: measure(spec) for spec in specs}
        Path(os.environ["BENCH_OUT"], f"rank{info.rank}.json").write_text(json.dumps(
            {"rank": info.rank, "world": info.world_size, "bytes": out, "step_s": [0.0],
             "first_step_s": 0.0, "peak_rss_mb": 0.0, "tokens_per_step": 0}))


if __name__ == "__main__":
    main()
