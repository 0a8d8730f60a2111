"""A model of the user's own for tests/faults/test_byo_model.py: not the GPT, a small MLP
regressor with dropout (so a resume must restore the dropout streams to be bit-exact),
taking a dict batch {"features", "target"} and returning the scalar MSE loss.
The other factories are deliberate mistakes for the error tests."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self, n_in: int = 8, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(width, 1))

    def forward(self, features: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(features).squeeze(-1), target)


def build(n_in: int = 8, width: int = 32, dropout: float = 0.1) -> Regressor:
    return Regressor(n_in, width, dropout)


class Predictor(Regressor):
    """Returns predictions, not a loss: needs train.loss = "byo_models:mse"."""

    def forward(self, features: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(features).squeeze(-1)


def build_predictor(**kwargs) -> Predictor:
    return Predictor(**kwargs)


def mse(model, batch) -> torch.Tensor:
    """A train.loss: fn(model, batch) -> scalar tensor."""
    return nn.functional.mse_loss(model(batch["features"]), batch["target"])


def build_positional(**kwargs) -> nn.Module:
    """forward(x) takes one positional tensor: a dict batch's keywords are rejected."""
    return nn.Linear(8, 1)


not_callable = 42


def returns_dict(**kwargs) -> dict:
    return {"not": "a module"}
