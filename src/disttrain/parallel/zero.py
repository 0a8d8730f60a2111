"""ZeRO-1: DDP for gradients plus `ZeroRedundancyOptimizer` for the optimizer state
(P-FSDP-9).

Each rank keeps the optimizer state (Adam's two moments) of its own partition of
the parameters only, steps that partition, then broadcasts the updated parameters.
Parameters and gradients stay replicated, as in DDP, so only the optimizer state
shrinks to about 1/N. The optimizer must be built after wrapping and be the ZeRO
one: `make_optimizer` does both (P-DDP-3).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from disttrain.errors import UserError
from disttrain.parallel.ddp import apply_ddp

WRAP_INFO = "_disttrain_wrap"
"""Attribute that `wrap` sets on the module it returns: a dict with 'strategy',
'precision' and 'world_size'."""


def apply_zero1(model: nn.Module, device: torch.device, **ddp_options) -> nn.Module:
    """DDP with disttrain's defaults; the optimizer side comes from `make_optimizer`."""
    return apply_ddp(model, device, **ddp_options)


def wrap_info(model: nn.Module) -> dict | None:
    """What `wrap` recorded on `model`, or None for a module `wrap` never saw."""
    return getattr(model, WRAP_INFO, None)


def make_optimizer(model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                   params: Iterable[Any] | None = None, **kwargs) -> torch.optim.Optimizer:
    """Build the optimizer for a wrapped model: ZeRO-1 under `zero1`, plain otherwise.

    `params` defaults to the model's trainable parameters; parameter groups (dicts)
    work too. `kwargs` go to `optimizer_class` (lr, betas, ...). Raises `UserError`
    for a module that `wrap` did not return, because the parameters of an unwrapped
    FSDP model are not the ones that will train (P-FSDP-7).
    """
    info = wrap_info(model)
    if info is None:
        raise UserError("make_optimizer() needs the module returned by dt.wrap(); wrap the model "
                        "first, then build the optimizer from it (P-DDP-3, P-FSDP-7).")
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if info["strategy"] == "zero1" and info["world_size"] > 1:
        # Imported here: torch.distributed.optim compiles TorchScript on import (~0.5 s+),
        # a cost every job would otherwise pay at start-up.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
    return optimizer_class(params, **kwargs)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise `UserError` when `optimizer` cannot train `model` as wrapped.

    Two mistakes are caught: an optimizer built before wrapping (its parameters are
    not the model's: FSDP replaced them with DTensor shards, so the step would
    update tensors that no longer take part, P-DDP-3, P-FSDP-7), and a plain
    optimizer under `zero1` (the optimizer state would not be sharded).
    """
    own = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in own:
                raise UserError("the optimizer holds parameters that are not the wrapped model's: "
                                "it was built before dt.wrap() (or from another model). Build it "
                                "after wrapping, from the returned module: "
                                "dt.make_optimizer(model, torch.optim.AdamW, lr=...) (P-DDP-3, "
                                "P-FSDP-7).")
    info = wrap_info(model)
    if info and info["strategy"] == "zero1" and info["world_size"] > 1 \
            and type(optimizer).__name__ != "ZeroRedundancyOptimizer":
        raise UserError("parallel.strategy is 'zero1' but the optimizer is a plain "
                        f"{type(optimizer).__name__}, so its state is not sharded. Build it with "
                        "dt.make_optimizer(model, torch.optim.AdamW, lr=...).")
