"""Which samples each rank trains on, compared across ranks: the same sample on two
ranks in one epoch, and a dataset split twice.

Every batch a training DataLoader yields in the window is reduced to one fingerprint
per sample (two float64 numbers: the sum of the sample's values, and their sum weighted
by position; see `sample_prints`). The ranks exchange the new ones at each checked step,
and every rank keeps the same table of which ranks saw which sample in the current
epoch (`SeenSamples`):
- samples that two ranks both trained on in one epoch, beyond what chance and a
  DistributedSampler's padding give (at least `MIN_SHARED` and `SHARED_SHARE` of those
  seen): the ranks' shares overlap, so part of the data is trained on twice per epoch
  and the rest never -- a stop, with each rank's sampler settings as the cause;
- a DistributedSampler that splits a dataset which is itself a different slice on each
  rank (a `Subset` with other indices, or another length): the data is split twice, so
  each rank sees 1/world of its slice and most of the epoch is never seen -- a stop.

Reads the batches the script asked for, never a sample it did not; draws no random
number. Bounded: `MAX_PER_STEP` samples per rank per step, `MAX_SEEN` per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Subset

from disttrain.check.verdicts import Finding

MAX_PER_STEP = 256
MAX_SEEN = 200_000
MIN_SHARED = 4
SHARED_SHARE = 0.1
HEAD = 8
"""Numbers per rank before the sample prints: split, length, known, indices (2), sampler
(3: replicas, rank, seed)."""


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch (nested lists, tuples, dicts; dict items by key) whose
    values this rank holds, in one fixed order: DTensors (a shard's sum would be a
    collective) and meta tensors (no values) are left out."""
    out, stack = [], [batch]
    while stack:
        item = stack.pop()
        if isinstance(item, DTensor) or (isinstance(item, torch.Tensor) and item.is_meta):
            continue
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item[k] for k in sorted(item, key=str))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def sample_prints(batch: Any) -> torch.Tensor:
    """[n, 2] float64: per sample of `batch` (the leading dimension of its first tensor),
    the sum of its values and their position-weighted sum, over every tensor of the batch
    with that leading dimension. Empty when the batch holds no tensor with a dimension."""
    tensors = [t for t in batch_tensors(batch) if t.dim() >= 1]
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.float64)
    n = tensors[0].shape[0]
    prints = torch.zeros(n, 2, dtype=torch.float64)
    with torch.no_grad():
        for t in tensors:
            if t.shape[0] != n or t.is_complex():
                continue
            rows = t.detach().reshape(n, -1).to("cpu", torch.float64)
            weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.float64) / max(1, rows.shape[1])
            prints[:, 0] += rows.sum(dim=1)
            prints[:, 1] += rows @ weights
    return prints


def _splitter(loader: DataLoader) -> Any:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
            return sampler
    return None


def loader_head(loader: DataLoader) -> list[float]:
    """`HEAD` numbers: whether a sampler splits the dataset over several ranks, the
    dataset's length, whether its slice is known (a Subset) and its indices' fingerprint,
    and the sampler's num_replicas, rank and seed (-1 without one)."""
    sampler = _splitter(loader)
    dataset = loader.dataset
    try:
        length = float(len(dataset))  # type: ignore[arg-type]
    except TypeError:
        length = -1.0
    known, a, b = 0.0, 0.0, 0.0
    if isinstance(dataset, Subset):
        idx = torch.as_tensor(list(dataset.indices), dtype=torch.float64)
        known, a = 1.0, float(idx.sum())
        b = float((idx * torch.arange(1, len(idx) + 1, dtype=torch.float64)).sum())
    if sampler is None:
        return [0.0, length, known, a, b, -1.0, -1.0, -1.0]
    replicas = float(getattr(sampler, "num_replicas", 1))
    seed = getattr(sampler, "seed", -1)
    return [float(replicas > 1), length, known, a, b, replicas, float(sampler.rank), float(seed)]


def split_twice(heads: list[torch.Tensor], line: str | None) -> Finding | None:
    """The data-split-twice finding in every rank's `loader_head`, or None."""
    if not all(bool(h[0] == 1) for h in heads):
        return None
    lengths = [int(h[1]) for h in heads]
    slices = {(float(h[3]), float(h[4])) for h in heads}
    other_slices = all(bool(h[2] == 1) for h in heads) and len(slices) > 1
    if len(set(lengths)) == 1 and not other_slices:
        return None
    per_rank = ", ".join(f"rank {r}: {n} samples" for r, n in enumerate(lengths))
    where = f" iterated at {line}" if line else ""
    world = len(heads)
    return Finding(
        "data",
        True,
        f"the dataset of the DataLoader{where} is already a different slice on each rank "
        f"({per_rank}{', other indices' if other_slices else ''}), and its DistributedSampler "
        f"splits it again over {int(heads[0][5])} ranks: the data is split twice, so each rank "
        f"trains on 1/{world} of its own slice and about {100 - 100 // world}% of every epoch "
        "is never seen. Fix: split once: give every rank the whole dataset and keep the "
        "DistributedSampler, or keep your per-rank slice and drop the sampler's split "
        "(a plain sampler, or shuffle=True).",
    )


@dataclass
class SeenSamples:
    """Which ranks saw which sample (by fingerprint) in the current epoch; the same
    table on every rank (built from the same gathered numbers)."""

    epoch: int = -1
    owners: dict[tuple[float, float], int] = field(default_factory=dict)
    """fingerprint -> bit mask of the ranks that trained on it this epoch."""
    shared: int = 0

    def add(self, epoch: int, prints: list[torch.Tensor]) -> None:
        """Every rank's new sample prints ([k, 2] each, rank order) at one checked step."""
        if epoch != self.epoch:
            self.epoch, self.owners, self.shared = epoch, {}, 0
        for rank, rows in enumerate(prints):
            for a, b in rows.tolist():
                key = (a, b)
                if key not in self.owners and len(self.owners) >= MAX_SEEN:
                    continue
                before = self.owners.get(key, 0)
                now = before | (1 << rank)
                if before and now != before and before.bit_count() == 1:
                    self.shared += 1
                self.owners[key] = now

    def overlapping(self) -> bool:
        return self.shared >= MIN_SHARED and self.shared >= SHARED_SHARE * len(self.owners)

    def pair(self) -> tuple[int, int]:
        """Two ranks that share a sample (the lowest)."""
        for mask in self.owners.values():
            if mask.bit_count() > 1:
                ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
                return ranks[0], ranks[1]
        return 0, 1


def shared_text(seen: SeenSamples, step: int, heads: list[torch.Tensor], line: str | None) -> str:
    a, b = seen.pair()
    where = f" iterated at {line}" if line else ""
    return (
        f"step {step}: ranks {a} and {b} trained on {seen.shared} of the same samples in epoch "
        f"{seen.epoch} (of {len(seen.owners)} samples seen so far) from the DataLoader{where}: "
        f"their shares of the data overlap, so some samples are trained on twice per epoch and "
        f"others never. {_sampler_cause(heads, a, b)}"
    )


def _sampler_cause(heads: list[torch.Tensor], a: int, b: int) -> str:
    ha, hb = heads[a], heads[b]
    if int(ha[5]) < 0 or int(hb[5]) < 0:
        return (
            "Fix: give the DataLoader a torch.utils.data.DistributedSampler(dataset) (the same "
            "seed on every rank) instead of shuffling on each rank."
        )
    settings = f"rank {a}: num_replicas={int(ha[5])}, rank={int(ha[6])}, seed={int(ha[7])}; "
    settings += f"rank {b}: num_replicas={int(hb[5])}, rank={int(hb[6])}, seed={int(hb[7])}"
    if int(ha[7]) != int(hb[7]):
        why = "the seeds differ, so each rank shuffles the data another way before taking its share"
    elif int(ha[6]) == int(hb[6]):
        why = "both take the same share (the same `rank=`; pass the global rank, not the local one)"
    else:
        why = "`num_replicas=` is not the number of ranks that split the data"
    return (
        f"Their DistributedSamplers ({settings}): {why}. Fix: DistributedSampler(dataset, "
        "seed=SEED) with the same seed on every rank, and let it take num_replicas and rank "
        "from the process group."
    )
