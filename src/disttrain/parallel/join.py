"""Uneven inputs: `join(model, optimizer)` wraps torch's `Join` context (P-LOOP-3).

When ranks have different numbers of batches, a rank that finishes early would
leave the others blocked in their next gradient all-reduce. Inside `join`, a rank
that ran out "shadows" the collectives of the ranks still training:

- DDP: the finished rank joins each all-reduce with zero gradients. Gradients are
  divided by the initial world size (torch's default `divide_by_initial_world_size`),
  so a step on fewer ranks is a smaller step, as if the missing ranks had
  contributed zero gradient. When all ranks are done, the model of the last rank
  to finish is broadcast to every rank, so the replicas end identical.
- ZeRO-1: the `ZeroRedundancyOptimizer` also joins, shadowing the parameter
  broadcasts of its step.

FSDP (both versions) does not implement Join. There, use `DistributedSampler`
(every rank gets the same number of batches: it pads or drops, P-DATA-1) instead.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable

from disttrain.errors import UserError
from disttrain.parallel.optimizers import wrap_info


def join(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, throw_on_early_termination: bool = False):
    """A context under which ranks may run different numbers of training steps.

    Contract: every rank enters it, runs its own batches, and leaves it; no rank
    hangs. Inside it, use only collectives that Join shadows (the DDP gradient
    all-reduce, the ZeRO step); another collective (a metric all-reduce, the fp16
    `AgreedGradScaler`) would wait for the finished rank. With
    `throw_on_early_termination=True` every rank raises as soon as one runs out,
    instead. In a world of 1 it is a null context. Raises `UserError` for a
    strategy without Join support (fsdp, fsdp1).
    """
    info = wrap_info(model) or {}
    if info.get("world_size", 1) <= 1 and not isinstance(model, Joinable):
        return contextlib.nullcontext()
    if info.get("strategy") in ("fsdp", "fsdp1"):
        raise UserError(
            f"dt.join() does not apply to strategy {info['strategy']!r}: FSDP does not "
            f"implement torch's Join. Give every rank the same number of batches with "
            f"dt.DistributedSampler (it pads or drops, P-DATA-1) instead (P-LOOP-3)."
        )
    joinables: list[Joinable] = []
    for each in (model, optimizer):
        if isinstance(each, Joinable):
            joinables.append(each)
    if not joinables:
        raise UserError(
            "dt.join() needs the module returned by dt.wrap() under ddp or zero1 "
            "(a DDP module is Joinable); this model is not."
        )
    return Join(joinables, throw_on_early_termination=throw_on_early_termination)
