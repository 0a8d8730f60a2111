"""The optimizer of a wrapped model, for every strategy: `make_optimizer` builds it after
`wrap` (P-DDP-3, P-FSDP-7), `check_optimizer` refuses one that cannot train the wrapped
model, `decay_groups` splits the parameters for weight decay by their names and shapes
in the plain model, and `build_optimizer` is the optimizer of `disttrain train`'s [optim].

ZeRO-1 (P-FSDP-9) is the optimizer's part of the `zero1` strategy: DDP for the
gradients plus `ZeroRedundancyOptimizer`, which keeps the optimizer state (Adam's two
moments) of this rank's partition of the parameters only, steps it, then broadcasts
the updated parameters. Parameters and gradients stay replicated, as in DDP, so only
the optimizer state shrinks to about 1/N. `make_optimizer` builds it under `zero1`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from disttrain.config import Config
from disttrain.errors import UserError
from disttrain.parallel.ddp import apply_ddp
from disttrain.runtime.torch_compat import canonical_name, fsdp1_unsharded_shapes, unwrap

WRAP_INFO = "_disttrain_wrap"
"""Attribute that `wrap` sets on the module it returns: a dict with 'strategy',
'precision' and 'world_size'."""


def apply_zero1(model: nn.Module, device: torch.device, **ddp_options) -> nn.Module:
    """DDP with disttrain's defaults; the optimizer side comes from `make_optimizer`."""
    return apply_ddp(model, device, **ddp_options)


def wrap_info(model: nn.Module) -> dict | None:
    """What `wrap` recorded on `model`, or None for a module `wrap` never saw."""
    return getattr(model, WRAP_INFO, None)


def make_optimizer(
    model: nn.Module, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any] | None = None, **kwargs
) -> torch.optim.Optimizer:
    """Build the optimizer for a wrapped model: ZeRO-1 under `zero1`, plain otherwise.

    `params` defaults to the model's trainable parameters; parameter groups (dicts)
    work too. `kwargs` go to `optimizer_class` (lr, betas, ...). Raises `UserError`
    for a module that `wrap` did not return, because the parameters of an unwrapped
    FSDP model are not the ones that will train (P-FSDP-7).
    """
    info = wrap_info(model)
    if info is None:
        raise UserError(
            "make_optimizer() needs the module returned by dt.wrap(); wrap the model "
            "first, then build the optimizer from it (P-DDP-3, P-FSDP-7)."
        )
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
                raise UserError(
                    "the optimizer holds parameters that are not the wrapped model's: "
                    "it was built before dt.wrap() (or from another model). Build it "
                    "after wrapping, from the returned module: "
                    "dt.make_optimizer(model, torch.optim.AdamW, lr=...) (P-DDP-3, "
                    "P-FSDP-7)."
                )
    info = wrap_info(model)
    if (
        info
        and info["strategy"] == "zero1"
        and info["world_size"] > 1
        and type(optimizer).__name__ != "ZeroRedundancyOptimizer"
    ):
        raise UserError(
            "parallel.strategy is 'zero1' but the optimizer is a plain "
            f"{type(optimizer).__name__}, so its state is not sharded. Build it with "
            "dt.make_optimizer(model, torch.optim.AdamW, lr=...)."
        )


def decaying(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(canonical name, parameter, whether it takes weight decay) for each trainable
    parameter of `model`, wrapped or plain, in order. A parameter decays when it has 2
    or more dimensions in the plain model (matrices, embeddings), as in GPT-2; biases
    and norms do not. Names are the plain model's (`torch_compat.canonical_name`), so a
    wrapped model and its plain model give the same list.

    Dimensions are the plain model's too: FSDP1 turns parameters into 1-D views of its
    flat shard, so its own shapes would put every matrix in the no-decay group; those
    are read from FSDP1's metadata (`fsdp1_unsharded_shapes`), and FSDP2's DTensors
    report their global shape. No collective."""
    flat = fsdp1_unsharded_shapes(model)
    return [
        (canonical_name(name), q, len(flat.get(id(q), tuple(q.shape))) >= 2)
        for name, q in unwrap(model).named_parameters()
        if q.requires_grad
    ]


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer parameter groups of `model`'s trainable parameters (`decaying`):
    those that decay with `weight_decay`, the rest with 0.0. Either may be empty."""
    named = decaying(model)
    return [
        {"params": [q for _, q, d in named if d], "weight_decay": weight_decay},
        {"params": [q for _, q, d in named if not d], "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """The optimizer of [optim] for the wrapped `model` (`make_optimizer`: ZeRO-1 under
    `zero1`, P-FSDP-9): AdamW with `decay_groups` (decay on matrices only), or SGD with
    momentum and one weight decay for every trainable parameter. Build it after `wrap`
    (P-DDP-3); raises `UserError` for a module `wrap` did not return."""
    o = cfg.optim
    if o.name == "sgd":
        params = [q for q in unwrap(model).parameters() if q.requires_grad]
        return make_optimizer(model, torch.optim.SGD, params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    groups = decay_groups(model, o.weight_decay)
    return make_optimizer(model, torch.optim.AdamW, groups, lr=o.lr, betas=tuple(o.betas))
