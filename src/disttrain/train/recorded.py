"""Two small facts `dt.Job` keeps about the objects a script hands it: which samples
each batch holds (the sample audit) and when each optimizer was built (one built
before `wrap` is refused)."""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterator

import torch

from disttrain.data import ElasticSampler
from disttrain.runtime import torch_compat


class Recorded(torch.utils.data.Sampler[int]):
    """The job's `ElasticSampler` as the DataLoader reads it: every index it hands out
    is queued, so each batch the loop receives knows its samples (the audit), whatever
    the dataset's items look like and however far the loader (or its workers)
    prefetch: the DataLoader draws indices in the order it returns batches."""

    def __init__(self, sampler: ElasticSampler):
        self.sampler, self.queue = sampler, collections.deque[int]()

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        self.queue.clear()
        for i in self.sampler:
            self.queue.append(i)
            yield i

    def take(self, n: int) -> list[int]:
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]


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
