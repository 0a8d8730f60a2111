"""The rule of `dt.Job` for the optimizer, the scheduler and backward, enforced: Job
steps what it was given. Inside `for batch in job.steps(...)` a user's own
`optimizer.step()`, `scheduler.step()` or `loss.backward()` (a leftover of the script
before the conversion) would step twice per step or skip the accumulation's
`no_sync`; each is one `UserError` at its first occurrence.

Watched without touching what the checkpoint saves: `Optimizer.register_step_pre_hook`
(a public hook), the scheduler's `last_epoch` compared after each batch, and the
autograd error of a second backward through the same graph.
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.errors import UserError

STEP_MESSAGE = (
    "dt.Job steps the {what} given to job.resume() on each accumulation boundary; "
    "remove the script's own `{call}` inside `for batch in job.steps(...)` (with it "
    "the {what} steps twice per step{extra})."
)
BACKWARD_MESSAGE = (
    "a `loss.backward()` ran inside `for batch in job.steps(...)` besides "
    "job.backward(loss); call only job.backward(loss) (it divides by accum_steps "
    "and skips the gradient sync between boundaries), once per batch."
)


class Ownership:
    """Brackets the user's code for each batch (`before_user` / `after_user`); Job's own
    optimizer and scheduler steps run outside it, so any step inside it is the user's."""

    def __init__(self) -> None:
        self.in_loop = False
        self._handle: Any = None
        self.scheduler: Any = None
        self._epoch: int | None = None

    def watch(self, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self._handle = optimizer.register_step_pre_hook(self._optimizer_step)
        self.scheduler = scheduler

    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.in_loop:
            raise UserError(STEP_MESSAGE.format(what="optimizer", call="optimizer.step()", extra=""))

    def before_user(self) -> None:
        """Right before the loop hands a batch to the user's code."""
        self.in_loop = True
        self._epoch = getattr(self.scheduler, "last_epoch", None)

    def left_loop(self) -> None:
        """The script left the loop mid-batch (`break`, `return`): its own steps after the
        loop are its business."""
        self.in_loop = False

    def after_user(self) -> None:
        """Right after the user's code for a batch (and its job.backward) returned."""
        self.in_loop = False
        if self._epoch is not None and self.scheduler.last_epoch != self._epoch:
            raise UserError(
                STEP_MESSAGE.format(
                    what="scheduler", call="scheduler.step()", extra=": the schedule runs twice as fast"
                )
            )

    @staticmethod
    def second_backward(e: RuntimeError) -> bool:
        return "backward through the graph a second time" in str(e)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def require_backward(done: bool) -> None:
    """After the user's code for one batch: `UserError` unless it called
    `job.backward(loss)` (a script's own `loss.backward()` does not count)."""
    if not done:
        raise UserError(
            "each batch from job.steps() needs one job.backward(loss) before the "
            "next; this one had none (a script's own loss.backward() does not "
            "count: call job.backward(loss))."
        )
