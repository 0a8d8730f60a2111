"""Which samples each batch of a `dt.Job` holds (the sample audit): the job's sampler
queues every index the DataLoader draws, and the loop takes a batch's share."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch

from disttrain.data import ElasticSampler


class SampleQueue(torch.utils.data.Sampler[int]):
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
        """The next `n` indices drawn (fewer when fewer are queued), oldest first."""
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
