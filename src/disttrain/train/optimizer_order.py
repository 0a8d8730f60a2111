"""When each optimizer was built, relative to `dt.Job.wrap`: one built before `wrap`
is refused by `resume` (FSDP replaces the parameters it holds)."""

from __future__ import annotations

import itertools
import weakref

import torch

from disttrain.runtime import torch_compat


def watch_optimizers() -> None:
    """From now on, each optimizer built in this process gets a serial number (a hook on
    its construction, `torch_compat.on_optimizer_built`). Idempotent."""
    torch_compat.on_optimizer_built(_number)


def optimizer_mark() -> int:
    """A serial number between the optimizers built before this call and after it."""
    return next(_SERIALS)


def built_after(optimizer: object, mark: int) -> bool:
    """Whether `optimizer` was built after `optimizer_mark()` returned `mark`. A torch
    optimizer built before `watch_optimizers` (before the job existed) was not numbered:
    False. An object that is no torch optimizer is not judged: True.

    The check an optimizer built before `wrap` needs (FSDP replaces the parameters;
    under DDP it works by accident, and the same script breaks when the strategy
    changes). It holds whatever the collector sees: a `gc.freeze()` at init, which hides
    every object alive before it from `gc.get_objects()`, changes nothing here."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return True
    return _BUILT.get(optimizer, 0) > mark


_SERIALS = itertools.count(1)
_BUILT: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _number(optimizer: torch.optim.Optimizer) -> None:
    _BUILT[optimizer] = next(_SERIALS)
