"""Datasets of the user's own for tests/faults/test_byo_model.py: generated map-style sets of
dict samples {"features": float[n_in], "target": float}, returned as (train, eval).
A private generator: the data never draws from the global RNG (the model's init)."""

from __future__ import annotations

import torch


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int, n_in: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, n_in, generator=g)
        w = torch.linspace(-1.0, 1.0, n_in)
        self.y = torch.sin(self.x @ w) + 0.05 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "target": self.y[i]}


def build(n_train: int = 64, n_eval: int = 24, n_in: int = 8) -> tuple[Points, Points]:
    return Points(n_train, n_in, seed=1), Points(n_eval, n_in, seed=2)


def build_train_only(n_train: int = 64, n_in: int = 8) -> Points:
    return Points(n_train, n_in, seed=1)


def build_iterable(**kwargs):
    return (i for i in range(10))
