"""disttrain: correct, fast PyTorch training on many devices, composed from native
torch.distributed parts. The public API is re-exported here; nothing else lives here.

    import disttrain as dt
    with dt.distributed(seed=0) as info:
        model = dt.wrap(MyModel(), strategy="ddp")
        optimizer = dt.make_optimizer(model, torch.optim.AdamW, lr=3e-4)  # after wrap
        acc = dt.Accumulator(model, optimizer, accum_steps=4)
        ...
"""

__version__ = "0.1.0"

from disttrain.checkpoint import (Checkpointer, TrainState, atomic_torch_save, load, load_model,
                                  save, save_model)
from disttrain.data import DistributedSampler
from disttrain.errors import ConfigError, DistributedMismatchError, UserError
from disttrain.guard import check_consistency, check_replicas, start_guard
from disttrain.loop import Accumulator, clip_grad_norm, no_sync, warmup_cosine
from disttrain.metrics import JsonlWriter, MeanTracker, global_mean, global_sum, print_main
from disttrain.parallel import Layout, join, make_optimizer, unwrap, wrap
from disttrain.precision import AgreedGradScaler, autocast, make_grad_scaler
from disttrain.runtime import RankInfo, barrier, distributed, init, rank_info, shutdown
from disttrain.sanity import NotDistributedError, NotDistributedWarning
from disttrain.watchdog import Watchdog

__all__ = [
    "Accumulator", "Checkpointer", "AgreedGradScaler", "Layout", "autocast", "join", "make_grad_scaler",
    "make_optimizer", "ConfigError", "DistributedMismatchError", "DistributedSampler", "JsonlWriter",
    "MeanTracker", "RankInfo", "TrainState", "UserError", "atomic_torch_save", "barrier", "clip_grad_norm",
    "distributed", "global_mean", "global_sum", "init", "load", "load_model", "no_sync", "print_main",
    "rank_info", "save", "save_model", "shutdown", "unwrap", "warmup_cosine", "wrap",
]
__all__ += ["NotDistributedError", "NotDistributedWarning", "Watchdog", "check_consistency", "check_replicas", "start_guard"]  # guardrails (P-DEBUG-1,3)
