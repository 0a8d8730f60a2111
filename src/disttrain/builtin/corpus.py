"""The built-in data: the bytes of the Python standard library's own .py files,
split by a hash of each path into training and held-out files, served as
next-byte windows.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from disttrain.errors import UserError


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune: site-packages is huge
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    if not files:
        raise UserError(
            f"no Python source files were found under {root}; the stdlib corpus needs the standard library's .py files."
        )
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


def load_stdlib_corpus(max_bytes: int, heldout_fraction: float, heldout_max_bytes: int | None = None) -> ByteCorpus:
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

    def to_tensor(b: bytearray) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).long()

    return ByteCorpus(to_tensor(train[:max_bytes]), to_tensor(heldout[:heldout_max_bytes]), n_train, n_heldout)


class ChunkDataset(Dataset):
    """Non-overlapping windows of `block_size + 1` tokens: (input, next-token target)."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) < block_size + 1:
            raise UserError(
                f"the corpus has {len(tokens)} tokens, fewer than one window of "
                f"block_size + 1 = {block_size + 1}; lower model.block_size."
            )
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]
