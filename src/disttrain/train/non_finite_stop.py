"""A `dt.Job` whose loss or weights became non-finite (NaN or infinity) stops before
it saves: a diverged state is never checkpointed over good ones.

The loss of each backward is watched locally (no collective); before a save every rank
also checks its own shards of the weights (`checkpoint/finite_tensors.py`), and one
all-reduce (MIN of the first bad step) makes every rank stop together with one line
naming the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain.checkpoint.finite_tensors import first_non_finite
from disttrain.errors import UserError
from disttrain.runtime.collectives import comm_device


class NonFiniteStop:
    """The first step whose loss was not finite, and the check a save runs first.

    `saved_at` returns the newest checkpoint's step (named in the error)."""

    def __init__(self, model: torch.nn.Module, saved_at: Callable[[], int | None]):
        self.model, self.saved_at = model, saved_at
        self.bad_step: int | None = None

    def watch_loss(self, loss, step: int) -> None:
        """Remember `step` when `loss` (a tensor) is not finite and no earlier step was
        bad; checked before the next save. Not a collective."""
        if self.bad_step is None and isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            self.bad_step = step

    def check(self, step: int) -> None:
        """A collective before each save: raise `UserError` on every rank when any rank
        saw a non-finite loss or holds non-finite weights."""
        bad = self.bad_step
        if bad is None and first_non_finite(self.model) is not None:  # this rank's shards
            bad = step
        first = torch.tensor([float(bad) if bad is not None else math.inf], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            first = first.to(comm_device())
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if math.isfinite(float(first.item())):
            raise UserError(
                f"training diverged: the loss or the weights became non-finite (nan/inf) "
                f"at step {int(first.item())}; stopped before saving it (the newest "
                f"checkpoint is step {self.saved_at()}). Lower the learning rate, "
                f"clip gradients, or check the data."
            )
