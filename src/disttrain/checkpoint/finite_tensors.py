"""Which tensors hold a NaN or an infinity: a non-finite state must stop a run before
it saves, and retention must know which checkpoints hold finite weights.

`check_finite(loss_or_tensors, step)` is a loop's check before each save: it raises
`NonFiniteError`, one line naming the step, when the loss or any tensor is not
finite. `all_finite(tree)` is the Checkpointer's per-rank answer for the model part
of a state dict, recorded in the manifest as `"finite"` so that `step_folders.prune` never
deletes the newest finite checkpoint for newer NaN ones.

Cost: one `isfinite(...).all()` per tensor, reduced on each device, and one host
sync per device, about one read of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from disttrain.errors import UserError


class NonFiniteError(UserError):
    """The loss or the weights are NaN or infinite at a step; the run stops before it
    saves, so every checkpoint on disk stays finite."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):
        return type(self), (str(self), self.step)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
    if callable(to_local):
        return to_local()
    shards = getattr(t, "local_shards", None)  # FSDP1's ShardedTensor: this rank's shards
    if callable(shards):
        parts = [s.tensor.reshape(-1) for s in shards()]
        return torch.cat(parts) if parts else torch.empty(0)
    return t


def _tensors(tree: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of every floating-point tensor in a module, dict, list or tensor."""
    if isinstance(tree, torch.nn.Module):
        # parameters and buffers, not state_dict(): FSDP1's state_dict is a collective
        yield from tree.named_parameters()
        yield from tree.named_buffers()
    elif isinstance(tree, torch.Tensor):
        yield "", tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            for name, t in _tensors(value):
                yield (f"{key}.{name}" if name else str(key)), t
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            for name, t in _tensors(value):
                yield (f"{i}.{name}" if name else str(i)), t


def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool: `t` holds no NaN and no infinity. From its minimum and maximum
    (one pass, NaN propagates into both): `isfinite(t).all()` writes a bool per
    element first, and measured 9x slower on a CPU."""
    if t.is_complex():
        return torch.isfinite(t).all()
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


class FiniteTally:
    """Whether every floating-point tensor `add`ed was finite, with one host sync per
    device in `all()` (a save's writer adds each model tensor it writes, so each
    rank checks exactly its share of the saved weights)."""

    def __init__(self):
        self._flags: dict[torch.device, list[torch.Tensor]] = {}

    def add(self, t: torch.Tensor) -> None:
        if (t.is_floating_point() or t.is_complex()) and t.numel() and t.device.type != "meta":
            self._flags.setdefault(t.device, []).append(_finite(t))

    def all(self) -> bool:
        return all(bool(torch.stack(flags).all()) for flags in self._flags.values())


def first_non_finite(tree: Any) -> str | None:
    """The name of the first floating-point tensor of `tree` holding a NaN or an
    infinity ('' for a bare tensor), or None when all are finite. One host sync per
    device when all are finite."""
    per_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in _tensors(tree):
        t = _local(t)
        if t.is_floating_point() or t.is_complex():
            if t.numel() and t.device.type != "meta":
                per_device.setdefault(t.device, []).append((name, t))
    for items in per_device.values():
        flags = torch.stack([_finite(t) for _, t in items])
        if not bool(flags.all()):
            return items[int((~flags).nonzero()[0])][0]
    return None


def all_finite(tree: Any) -> bool:
    """True when every floating-point tensor of `tree` is finite (this rank's shards)."""
    return first_non_finite(tree) is None


def check_finite(loss_or_tensors: Any, step: int) -> None:
    """Raise `NonFiniteError` (one line naming `step`) when `loss_or_tensors` is not
    finite: a Python number, a tensor (a loss), a module (its parameters and buffers),
    or a dict/list of tensors. Call it on every rank before a save, with the loss all
    ranks agree on (an all-reduced one) or with the model, so that every rank stops
    together. Returns None when all is finite."""
    if isinstance(loss_or_tensors, (int, float)) and not isinstance(loss_or_tensors, bool):
        bad = None if math.isfinite(loss_or_tensors) else ""
        value = f" ({loss_or_tensors})"
    else:
        bad = first_non_finite(loss_or_tensors)
        value = ""
    if bad is None:
        return
    what = f"tensor {bad!r}" if bad else "the loss" + value
    raise NonFiniteError(
        f"step {step}: {what} is not finite (NaN or infinity), so the run stops before saving; the "
        f"checkpoints on disk are those of earlier steps. Lower optim.lr, keep optim.grad_clip > 0, "
        f"or use precision bf16 instead of fp16, then resume.",
        step,
    )
