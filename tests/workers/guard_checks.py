"""Worker: the consistency, divergence and "looks distributed but is not" checks in one
process-group launch. Each rank writes OUT/rank{r}.json; tests/faults/test_guard.py asserts."""

import json
import sys
import warnings
from pathlib import Path

import torch

import disttrain as dt
from disttrain import guard
from disttrain.builtin import MLP, MLPConfig
from disttrain.config import Config
from disttrain.guard import sanity

out = Path(sys.argv[1])
results: dict = {}


def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        return None
    except dt.UserError as e:
        return f"{type(e).__name__}: {e}"


def warning_of(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        err = error_of(fn, *args, **kwargs)
    texts = [str(w.message) for w in caught if issubclass(w.category, sanity.NotDistributedWarning)]
    return err or (texts[0] if texts else None)


with dt.distributed(seed=0, timeout_s=60) as info:
    r = info.rank
    cfg = Config()
    fields = dict(accum_steps=2, dataset_len=1000, strategy="ddp")
    # The same job everywhere: no error.
    results["same"] = error_of(guard.check_consistency, model=MLP(MLPConfig()), config=cfg, **fields)
    # Rank 1 runs a different config (one learning rate).
    other = Config()
    other.optim.lr = 0.5 if r == 1 else other.optim.lr
    results["config"] = error_of(guard.check_consistency, model=MLP(MLPConfig()), config=other, **fields)
    # Rank 1 builds a different model (a wider hidden layer).
    model = MLP(MLPConfig(hidden=64 if r == 1 else 32))
    results["model"] = error_of(guard.check_consistency, model=model, config=cfg, **fields)
    # Rank 1 reads a dataset of another length.
    results["field"] = error_of(guard.check_consistency, config=cfg,
                                **{**fields, "dataset_len": 999 if r == 1 else 1000})

    # Replica divergence under DDP: fine after synced steps, caught after a rank-1-only edit.
    torch.manual_seed(0)
    ddp = dt.wrap(MLP(MLPConfig()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _step in range(1, 3):
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        opt.zero_grad()
        ddp(x, y)[1].backward()
        opt.step()
    results["replicas_ok"] = error_of(guard.check_replicas, ddp, 2)
    if r == 1:
        with torch.no_grad():
            list(dt.unwrap(ddp).parameters())[1].add_(1e-6)
    results["replicas_diverged"] = error_of(guard.check_replicas, ddp, 3)

    # Looks distributed but is not.
    plain = MLP(MLPConfig())
    results["unwrapped"] = warning_of(sanity.check_wrapped, plain,
                                      torch.optim.SGD(plain.parameters(), lr=0.1))
    results["wrapped"] = warning_of(sanity.check_wrapped, ddp, opt)
    results["optimizer_other_copy"] = warning_of(
        sanity.check_wrapped, ddp, torch.optim.SGD(MLP(MLPConfig()).parameters(), lr=0.1))
    same_batch = torch.arange(8.0).reshape(2, 4)
    results["same_batch"] = warning_of(sanity.check_first_batch, (same_batch, same_batch))
    results["own_batch"] = warning_of(sanity.check_first_batch, (same_batch + r, same_batch))
    results["strict_same_batch"] = error_of(sanity.check_first_batch, same_batch, strict=True)
    torch.set_num_threads(sanity.usable_cores())  # x 2 ranks on this host > cores
    results["threads"] = warning_of(sanity.check_threads, local_world=2)
    torch.set_num_threads(1)
    results["threads_ok"] = warning_of(sanity.check_threads, local_world=2)
    results["world_ok"] = error_of(sanity.check_world_size, 2)
    results["world_short"] = error_of(sanity.check_world_size, 3)

    (out / f"rank{r}.json").write_text(json.dumps(results))
