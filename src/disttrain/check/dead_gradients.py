"""A loss that does not reach the parameters: every gradient exactly zero, step after step.

Backward runs, the optimizer steps, nothing fails, and the model does not move (but for
weight decay). A loss that is constant in the model's output does this: cross_entropy
over a single output column (its log-softmax is always 0), a loss multiplied by a
zero mask, a target compared with itself. The witness is in the numbers the replica
check gathers already: at `STEPS` checked steps in a row, every gradient the optimizer
holds has a sum of absolute values of exactly 0 on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrain.check.verdicts import Finding

STEPS = 3


def all_zero(body: list[torch.Tensor]) -> bool:
    """Whether every rank's gradients (the `before_values` rows) are all exactly zero,
    at least one parameter having one (None gradients are left out)."""
    sums = torch.stack([b.reshape(-1, 4)[:, 1] for b in body])
    present = sums >= 0
    return bool(present.any()) and bool((sums[present] == 0).all())


@dataclass
class ZeroStreak:
    """Checked steps in a row whose gradients were all zero."""

    steps: int = 0

    def add(self, zero: bool) -> bool:
        """Count one checked step; True once `STEPS` in a row were all zero."""
        self.steps = self.steps + 1 if zero else 0
        return self.steps >= STEPS


def finding(step: int, n_params: int, line: str | None) -> Finding:
    where = f" at {line}" if line else ""
    return Finding(
        "gradients",
        True,
        f"steps {step - STEPS + 1}-{step}: every gradient of the optimizer's {n_params} parameters "
        f"was exactly zero on every rank before optimizer.step(){where}: the loss does not "
        "depend on the model's parameters, so the model does not learn. Common causes: "
        "cross_entropy over a single output column (its log-softmax is always 0; use "
        "binary_cross_entropy_with_logits or mse_loss), a loss multiplied by an all-zero "
        "mask, a target taken from the output itself. Fix: make the model's output take part "
        "in the loss.",
    )
