"""`ElasticSampler`: exactly-once data across restarts and world-size changes
(P-DATA-1..4, P-ELASTIC-3).

The global order of an epoch is a permutation that depends only on (seed, epoch).
The sampler's state is (epoch, cursor): the number of global positions consumed by
committed optimizer steps. A step consumes one global batch
G = batch_size x world_size x accum_steps of consecutive positions; rank r takes
positions cursor + r, cursor + r + world, ... so each micro-batch of the world
covers a contiguous range. On resume, at any world size, the rest of the epoch
[cursor, end) is split over the new ranks: every index is consumed exactly once.

The end of an epoch follows `drop_last`: True drops the positions that do not fill
a global batch; False pads the rest of the epoch to a multiple of G by repeating indices from
the start of the epoch's order, and counts them in `padded`.

Iterable datasets: the contract is the same. The dataset must be able to produce
sample `i` of an epoch on demand (a deterministic, indexable stream) so the cursor
can be resumed; a stream that can only be read forward cannot be resumed exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

from disttrain.data.distributed_sampler import epoch_permutation
from disttrain.errors import UserError
from disttrain.runtime import rank_info


class ElasticSampler(Sampler[int]):
    """Yields this rank's indices for the rest of the current epoch.

    Call `commit_step()` after every optimizer step (the trainer and `Accumulator`
    users do); the epoch advances by itself when its last step is committed.
    `state_dict()` is world-size independent. The first argument is the dataset
    (anything with `len()`, as torch's samplers take) or its length.

    Contract: across any sequence of kills, resumes and world-size changes, every
    sample of an epoch is drawn once (with `drop_last=False` the last step is padded
    by repetition, as torch's DistributedSampler does). `rank` and `world_size`
    default to `dt.rank_info()`'s; `batch_size` is per rank and micro-batch. Refused
    with a `UserError`: a dataset without `len()`, an empty one, a `batch_size` or
    `accum_steps` below 1, `drop_last=True` with fewer samples than one global
    batch, and (in `load_state_dict`) a state from a dataset of another length or
    another seed.
    """

    def __init__(
        self,
        dataset_len: int | Sized,
        *,
        batch_size: int,
        accum_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        info = rank_info()
        self.rank = info.rank if rank is None else rank
        self.world_size = info.world_size if world_size is None else world_size
        if not isinstance(dataset_len, int):
            if not hasattr(dataset_len, "__len__"):
                raise UserError(
                    f"ElasticSampler needs a dataset with len() or a sample count, got "
                    f"{type(dataset_len).__name__}; a stream without a length cannot "
                    f"be resumed exactly."
                )
            dataset_len = len(dataset_len)
        if dataset_len < 1:
            raise UserError("the dataset is empty; a sampler needs at least one sample.")
        if batch_size < 1 or accum_steps < 1:
            raise UserError(f"batch_size ({batch_size}) and accum_steps ({accum_steps}) must be >= 1.")
        self.n, self.seed, self.shuffle, self.drop_last = dataset_len, seed, shuffle, drop_last
        self.batch_size, self.accum_steps = batch_size, accum_steps
        if drop_last and self.global_batch > self.n:  # not one full step
            raise UserError(
                f"drop_last=True with {self.n} samples and a global batch of "
                f"{self.global_batch} leaves no full step; lower the batch or "
                f"use drop_last=False."
            )
        self.epoch = 0
        self.cursor = 0
        self.saved_global_batch = self.global_batch
        """The global batch of the run that wrote the loaded state (for batch policies)."""

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: batch_size x world_size x accum_steps."""
        return self.batch_size * self.world_size * self.accum_steps

    def steps_left(self) -> int:
        """Global steps left in the epoch from the committed cursor, for the current G.

        Counted from the cursor, not from 0, so a change of G mid-epoch (another world
        size) neither skips nor repeats a position.
        """
        left, g = max(0, self.n - self.cursor), self.global_batch
        return left // g if self.drop_last else math.ceil(left / g)

    def epoch_end(self) -> int:
        return self.cursor + self.steps_left() * self.global_batch

    @property
    def padded(self) -> int:
        """Repeated samples at the end of the current epoch (0 with drop_last)."""
        return max(0, self.epoch_end() - self.n)

    def __len__(self) -> int:
        """This rank's remaining samples in the epoch."""
        return self.steps_left() * self.global_batch // self.world_size

    def epoch_order(self, epoch: int) -> list[int]:
        """The global order of `epoch`: a permutation seeded by (seed, epoch) only."""
        return epoch_permutation(self.n, self.seed, epoch, self.shuffle)

    def index_at(self, order: list[int], position: int) -> int:
        # Positions past n are padding: they repeat the epoch's order from its start.
        return order[position % self.n]

    def __iter__(self) -> Iterator[int]:
        # Not a generator: the state read here is the committed one at iter() time.
        if self.steps_left() == 0:
            self._next_epoch()
        order = self.epoch_order(self.epoch)
        positions = range(self.cursor + self.rank, self.epoch_end(), self.world_size)
        return iter([self.index_at(order, p) for p in positions])

    def step_indices(self, step_in_epoch_cursor: int | None = None) -> list[int]:
        """All ranks' indices of the next global step (for logs and exactly-once audits)."""
        start = self.cursor if step_in_epoch_cursor is None else step_in_epoch_cursor
        order = self.epoch_order(self.epoch)
        return [self.index_at(order, p) for p in range(start, start + self.global_batch)]

    def commit_step(self) -> None:
        """Record one optimizer step's global batch as consumed."""
        self.cursor += self.global_batch
        if self.steps_left() == 0:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.cursor = 0

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning (explicit control; never needed in a loop)."""
        self.epoch, self.cursor = epoch, 0

    def state_dict(self) -> dict:
        """The committed position (epoch, cursor) with the dataset length, seed and global
        batch: plain numbers, independent of the world size."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "n": self.n,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, cursor), at any world size. Raises `UserError` when the
        checkpoint was taken on a dataset of another length or another seed."""
        if state["n"] != self.n or state["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's sampler was built for {state['n']} samples with seed "
                f"{state['seed']}, this run has {self.n} samples with seed {self.seed}; "
                f"resume with the same dataset and train.seed."
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.saved_global_batch = int(state.get("global_batch", self.global_batch))

    def reconfigure(
        self, *, world_size: int, rank: int, accum_steps: int | None = None, batch_size: int | None = None
    ) -> None:
        """Adopt a new world layout (after a re-rendezvous); the cursor stays."""
        self.world_size, self.rank = world_size, rank
        self.accum_steps = accum_steps or self.accum_steps
        self.batch_size = batch_size or self.batch_size
