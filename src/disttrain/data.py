"""Data for distributed training: a sampler that cannot forget its epoch, and the
byte corpus that the main job learns from.

`DistributedSampler` gives each rank a disjoint shard of one global permutation
that depends only on (seed, epoch) (P-DATA-1). Every `iter()` advances the epoch by
itself, so the "same order every epoch" trap of a forgotten `set_epoch` cannot
happen (P-DATA-2); `set_epoch` still works for explicit control.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import Dataset, Sampler

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
    """

    def __init__(self, dataset_len: int | Dataset, *, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, epoch: int = 0):
        n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        info = rank_info()
        self.rank = info.rank if rank is None else rank
        self.world_size = info.world_size if world_size is None else world_size
        if n < 1:
            raise UserError("the dataset is empty; a sampler needs at least one sample.")
        if drop_last and n < self.world_size:
            raise UserError(f"drop_last=True with {n} samples and {self.world_size} ranks leaves "
                            f"no sample for some ranks; use drop_last=False or more data.")
        self.n, self.seed, self.shuffle, self.drop_last = n, seed, shuffle, drop_last
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)

    def set_epoch(self, epoch: int) -> None:
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


# ---------------------------------------------------------------- the byte corpus


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune: site-packages is huge
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    if not files:
        raise UserError(f"no Python source files were found under {root}; the stdlib corpus "
                        f"needs the standard library's .py files.")
    return sorted(files)


def _is_heldout(path: Path, fraction: float) -> bool:
    # A hash of the path, not a random draw: the split is the same on every rank and run.
    h = int(hashlib.sha1(path.name.encode() + str(path.parent.name).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


@dataclass
class ByteCorpus:
    """Training and held-out bytes; held-out files are never trained on."""

    train: torch.Tensor
    heldout: torch.Tensor
    files_train: int
    files_heldout: int


def load_stdlib_corpus(max_bytes: int, heldout_fraction: float,
                       heldout_max_bytes: int | None = None) -> ByteCorpus:
    """Read stdlib source as bytes until `max_bytes` of training text (deterministic)."""
    heldout_max_bytes = heldout_max_bytes or max(max_bytes // 10, 65_536)
    train, heldout, n_train, n_heldout = bytearray(), bytearray(), 0, 0
    for path in stdlib_files():
        held = _is_heldout(path, heldout_fraction)
        buf, cap = (heldout, heldout_max_bytes) if held else (train, max_bytes)
        if len(buf) >= cap:
            if len(train) >= max_bytes and len(heldout) >= heldout_max_bytes:
                break
            continue
        buf += path.read_bytes()
        n_heldout, n_train = n_heldout + held, n_train + (not held)
    to_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()
    return ByteCorpus(to_tensor(train[:max_bytes]), to_tensor(heldout[:heldout_max_bytes]),
                      n_train, n_heldout)


class ChunkDataset(Dataset):
    """Non-overlapping windows of `block_size + 1` tokens: (input, next-token target)."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) < block_size + 1:
            raise UserError(f"the corpus has {len(tokens)} tokens, fewer than one window of "
                            f"block_size + 1 = {block_size + 1}; lower model.block_size.")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]
