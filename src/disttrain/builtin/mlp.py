"""A two-layer MLP with optional BatchNorm: the model for first runs of a new set-up
(P-LOOP-7) and for SyncBatchNorm tests (P-DDP-8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class MLPConfig:
    in_features: int = 16
    hidden: int = 32
    out_features: int = 4
    batchnorm: bool = False


class MLP(nn.Module):
    """`forward(x, targets)` returns (output, MSE loss or None)."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.fc1 = nn.Linear(cfg.in_features, cfg.hidden)
        self.norm = nn.BatchNorm1d(cfg.hidden) if cfg.batchnorm else nn.Identity()
        self.fc2 = nn.Linear(cfg.hidden, cfg.out_features)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        out = self.fc2(F.relu(self.norm(self.fc1(x))))
        loss = F.mse_loss(out, targets) if targets is not None else None
        return out, loss
