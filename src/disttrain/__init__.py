"""disttrain: correct, fast PyTorch training on many devices, composed from native
torch.distributed parts. The public API is re-exported here; nothing else lives here.

    import disttrain as dt
    with dt.distributed(seed=0) as info:
        model = dt.wrap(MyModel(), strategy="ddp")
        optimizer = dt.make_optimizer(model, torch.optim.AdamW, lr=3e-4)  # after wrap
        acc = dt.Accumulator(model, optimizer, accum_steps=4)
        ...

Names are imported lazily on first use, so `import disttrain` (and commands that do
not train, such as `disttrain doctor`) does not pay for `import torch`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from disttrain.version import __version__  # noqa: F401

# public name -> the module that defines it
_EXPORTS = {
    "disttrain.checkpoint": [
        "Checkpointer",
        "TrainState",
        "atomic_torch_save",
        "load",
        "load_model",
        "save",
        "save_model",
    ],
    "disttrain.config": [
        "CheckpointConfig",
        "Config",
        "DataConfig",
        "ElasticConfig",
        "GPTConfig",
        "GuardConfig",
        "LogConfig",
        "ModelConfig",
        "OptimConfig",
        "ParallelConfig",
        "TrainConfig",
    ],
    "disttrain.data": ["DistributedSampler", "ElasticSampler", "TokenWindows"],
    "disttrain.errors": ["ConfigError", "DistributedMismatchError", "UserError"],
    "disttrain.guard": ["check_consistency", "check_replicas", "start_guard"],
    "disttrain.train.job": ["Job"],
    "disttrain.train.job_config": ["RunOptions"],
    "disttrain.train.evaluation": ["Evaluator"],
    "disttrain.train.trackers": ["MlflowTracker", "WandbTracker"],
    "disttrain.train.accumulation": ["Accumulator", "clip_grad_norm", "no_sync", "warmup_cosine"],
    "disttrain.train.global_metrics": ["MeanTracker", "global_mean", "global_sum"],
    "disttrain.train.rank0_output": ["JsonlWriter", "print_main"],
    "disttrain.parallel": ["Layout", "join", "make_optimizer", "unwrap", "wrap"],
    "disttrain.parallel.precision": ["AgreedGradScaler", "autocast", "make_grad_scaler"],
    "disttrain.runtime": ["RankInfo", "barrier", "distributed", "init", "rank_info", "shutdown"],
    "disttrain.guard.sanity": ["NotDistributedError", "NotDistributedWarning"],
    "disttrain.guard.watchdog": ["Watchdog"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'disttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next access is a plain global lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static tools see the real names
    from disttrain.checkpoint import (
        Checkpointer,
        TrainState,
        atomic_torch_save,
        load,
        load_model,
        save,
        save_model,
    )
    from disttrain.config import (
        CheckpointConfig,
        Config,
        DataConfig,
        ElasticConfig,
        GPTConfig,
        GuardConfig,
        LogConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )
    from disttrain.data import DistributedSampler, ElasticSampler, TokenWindows
    from disttrain.errors import ConfigError, DistributedMismatchError, UserError
    from disttrain.guard import check_consistency, check_replicas, start_guard
    from disttrain.guard.sanity import NotDistributedError, NotDistributedWarning
    from disttrain.guard.watchdog import Watchdog
    from disttrain.parallel import Layout, make_optimizer, unwrap, wrap
    from disttrain.parallel.join import join
    from disttrain.parallel.precision import AgreedGradScaler, autocast, make_grad_scaler
    from disttrain.runtime import RankInfo, barrier, distributed, init, rank_info, shutdown
    from disttrain.train.accumulation import Accumulator, clip_grad_norm, no_sync, warmup_cosine
    from disttrain.train.evaluation import Evaluator
    from disttrain.train.global_metrics import MeanTracker, global_mean, global_sum
    from disttrain.train.job import Job
    from disttrain.train.job_config import RunOptions
    from disttrain.train.rank0_output import JsonlWriter, print_main
    from disttrain.train.trackers import MlflowTracker, WandbTracker
