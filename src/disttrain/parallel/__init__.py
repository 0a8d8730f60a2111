"""`wrap(model, ...)`: one entry point for every data-parallel strategy.

Each strategy is a plain function `apply_x(model, ...)` in its own module. `wrap`
validates the request, moves the model to this rank's device, applies the strategy,
and switches the RNGs to the per-rank stream. Build the optimizer after `wrap`
(P-DDP-3, P-FSDP-7).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from disttrain.config import ParallelConfig, STRATEGIES
from disttrain.errors import ConfigError, UserError
from disttrain.parallel.ddp import apply_ddp
from disttrain.runtime import rank_info, seed_rank_stream


def _parallel_config(cfg: ParallelConfig | None, overrides: dict) -> ParallelConfig:
    cfg = dataclasses.replace(cfg or ParallelConfig(), **{})
    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    for key, value in overrides.items():
        if key not in names:
            raise ConfigError(f"wrap() got an unknown option {key!r}; valid options: "
                              f"{', '.join(sorted(names))}.")
        setattr(cfg, key, value)
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"strategy {cfg.strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}.")
    return cfg


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (DDP/DataParallel `.module`)."""
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def wrap(model: nn.Module, cfg: ParallelConfig | None = None, **options) -> nn.Module:
    """Apply the configured strategy and return the module to train.

    `options` override fields of `cfg` (for example `strategy="ddp"`,
    `bucket_cap_mb=50`). In a world of 1 the model is only moved to the device.
    Raises `UserError` for a model that is already wrapped (nested wrapping, P-DDP-3)
    and `ConfigError` for an unknown option or strategy.
    """
    cfg = _parallel_config(cfg, options)
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise UserError(f"the model is already wrapped in {type(model).__name__}; wrapping it "
                        f"again nests data parallelism (P-DDP-3). Pass the plain module.")
    info = rank_info()
    model = model.to(info.device)
    if cfg.strategy != "ddp":
        raise ConfigError(f"strategy {cfg.strategy!r} is not available in this build yet; use 'ddp'.")
    if info.world_size > 1:
        model = apply_ddp(model, info.device, bucket_cap_mb=cfg.bucket_cap_mb,
                          gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                          static_graph=cfg.static_graph,
                          find_unused_parameters=cfg.find_unused_parameters)
    seed_rank_stream(info)
    return model
