"""Two small facts `dt.Job` keeps about the objects a script hands it: which samples
each batch holds (the sample audit) and which optimizers existed before `wrap`."""

from __future__ import annotations

import collections
import gc
import weakref
from typing import Iterator

import torch

from disttrain.data import ElasticSampler


class Recorded(torch.utils.data.Sampler[int]):
    """The job's `ElasticSampler` as the DataLoader reads it: every index it hands out
    is queued, so each batch the loop receives knows its samples (the audit), whatever
    the dataset's items look like and however far the loader (or its workers)
    prefetch: the DataLoader draws indices in the order it returns batches."""

    def __init__(self, sampler: ElasticSampler):
        self.sampler, self.queue = sampler, collections.deque()

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        self.queue.clear()
        for i in self.sampler:
            self.queue.append(i)
            yield i

    def take(self, n: int) -> list[int]:
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]


def optimizers_of(model: torch.nn.Module) -> "weakref.WeakSet[torch.optim.Optimizer]":
    """The live optimizers that hold a parameter of `model` (before it is wrapped): one
    of them handed to `Job.resume` was built before `wrap`, a mistake under every
    strategy (FSDP replaces the parameters; under DDP it works by accident, and the
    same script breaks when the strategy changes). One pass over the collector's
    objects, once per job."""
    own = {id(p) for p in model.parameters()}
    found: weakref.WeakSet = weakref.WeakSet()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer) and any(
                id(p) in own for g in obj.param_groups for p in g["params"]):
            found.add(obj)
    return found
