"""A sampler that cannot forget its epoch.

`DistributedSampler` gives each rank a disjoint shard of one global permutation
that depends only on (seed, epoch) (P-DATA-1). Every `iter()` advances the epoch by
itself, so the "same order every epoch" trap of a forgotten `set_epoch` cannot
happen (P-DATA-2); `set_epoch` still works for explicit control.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from disttrain.errors import UserError
from disttrain.runtime import rank_info


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of `epoch`: a permutation of range(n) seeded by (seed, epoch) only,
    never by the rank layout. Shared by both samplers."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class DistributedSampler(Sampler[int]):
    """Shards `len(dataset)` indices over ranks; the epoch advances on each `iter()`.

    The global order of an epoch is a permutation seeded by (seed, epoch). With
    `drop_last=False` the tail is padded by repeating indices from the start so every
    rank gets the same count (DistributedSampler semantics); with `drop_last=True`
    the tail that does not divide is dropped. Rank r takes global positions
    r, r + world, r + 2*world, ...

    Unlike torch's sampler, forgetting `set_epoch` cannot repeat an epoch's order:
    each `iter()` uses the current epoch and then advances it. `rank` and
    `world_size` default to `dt.rank_info()`'s. It keeps no position inside an
    epoch, so a resume restarts the epoch; use `ElasticSampler` for exactly-once
    resume. Refused with a `UserError`: an empty dataset, and `drop_last=True` with
    fewer samples than ranks.
    """

    def __init__(
        self,
        dataset_len: int | Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        epoch: int = 0,
    ):
        n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        info = rank_info()
        self.rank = info.rank if rank is None else rank
        self.world_size = info.world_size if world_size is None else world_size
        if n < 1:
            raise UserError("the dataset is empty; a sampler needs at least one sample.")
        if drop_last and n < self.world_size:
            raise UserError(
                f"drop_last=True with {n} samples and {self.world_size} ranks leaves "
                f"no sample for some ranks; use drop_last=False or more data."
            )
        self.n, self.seed, self.shuffle, self.drop_last = n, seed, shuffle, drop_last
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` draw `epoch`'s order (then it advances by itself)."""
        self.epoch = epoch

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's global index order, padded or trimmed to a multiple of world size."""
        order = epoch_permutation(self.n, self.seed, epoch, self.shuffle)
        total = len(self) * self.world_size
        if total > self.n:  # pad by repetition, as torch's DistributedSampler does
            order += (order * math.ceil(total / self.n))[: total - self.n]
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        # Not a generator: the epoch must advance when iter() is called, not lazily.
        epoch = self.epoch
        self.epoch += 1
        return iter(self.global_order(epoch)[self.rank :: self.world_size])
