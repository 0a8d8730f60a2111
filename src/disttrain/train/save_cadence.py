"""When a run checkpoints, and what a failed save does: the part of `dt.Job` (and so of
`disttrain train`) that owns the `Checkpointer`.

`Saving` decides its own cadence: every `every` optimizer steps, every `every_s`
seconds of training (agreed by all ranks, so every rank saves after the same step),
on an agreed stop (SIGTERM) and at the end. The loop calls `after_step(step, stop)`
once per committed step and `finish(step)` once at the end; nothing else.

`on_error`: 'stop' (a failed save raises `CheckpointSaveError` on every rank) or
'continue' (rank 0 warns and training goes on; the previous checkpoint stays the
newest, the same step is not retried). A `StaleWriterError` (another job took the
directory over) always propagates.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from disttrain.checkpoint import Checkpointer, CheckpointSaveError, TrainState
from disttrain.guard import tensor_nbytes
from disttrain.runtime.collectives import comm_device
from disttrain.runtime.log import LOGGER

CLOCK_CHECK_FRACTION = 0.05
"""The time-based cadence asks the ranks (one all-reduce) at most once per this
fraction of `every_s`, measured in steps from the slowest rank's step time."""


class SaveClock:
    """Time-based cadence agreed across ranks: `due(step)` is True on every rank after
    the same step, once `every_s` seconds passed since the last save on the slowest
    rank. A collective only at the steps it checks, the same steps on every rank: the
    stride in steps comes from the all-reduced (MAX) elapsed time and step count."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.reset(0)

    def reset(self, step: int) -> None:
        self.since, self.since_step, self.next_check = time.monotonic(), step, step + 1

    def due(self, step: int) -> bool:
        if not self.every_s or step < self.next_check:
            return False
        elapsed = time.monotonic() - self.since
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([elapsed], dtype=torch.float64, device=comm_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed = float(t.item())
        if elapsed >= self.every_s:
            return True
        per_step = elapsed / max(1, step - self.since_step)
        stride = 1 if per_step <= 0 else int(CLOCK_CHECK_FRACTION * self.every_s / per_step)
        self.next_check = step + max(1, min(stride, math.ceil((self.every_s - elapsed) / max(per_step, 1e-9))))
        return False


class _NoGuard:
    """Saving without a run guard (a test, a tool): no slow phases."""

    @staticmethod
    def slow_phase(name: str, nbytes: int = 0):
        return contextlib.nullcontext()


class Saving:
    """The run's checkpointer with its cadence and error policy (see the module)."""

    def __init__(
        self,
        ckpt: Checkpointer | None,
        state: TrainState,
        guard,
        *,
        every: int = 0,
        every_s: float = 0.0,
        on_error: str = "stop",
        who: str = "disttrain",
    ):
        self.ckpt, self.state, self.guard = ckpt, state, guard or _NoGuard()
        self.every, self.clock, self.on_error, self.who = every, SaveClock(every_s), on_error, who
        self.saved_at = state.step
        self.check: Callable[[int], None] | None = None
        """Called with the step before each save (a collective): the loop's non-finite stop."""
        self.checked_at = -1

    def start(self, step: int) -> None:
        """The step the run starts at (a resume's): it is on disk already."""
        self.saved_at = step
        self.clock.reset(step)

    def after_step(self, step: int, stop: bool) -> None:
        """Save when the cadence says so or the run stops here (collective)."""
        if self.ckpt is None:
            return
        due = stop or (self.every and step % self.every == 0)
        if self.clock.due(step) or due:
            self.save(step)

    def finish(self, step: int) -> None:
        """The final save (unless this step is saved) and the end of any async save."""
        if self.ckpt is None:
            return
        if self.saved_at != step:
            self.save(step)
        with self.guard.slow_phase("checkpoint.save", nbytes=self._nbytes()):
            try:
                self.ckpt.close()
            except CheckpointSaveError as e:
                self._failed(e)

    def save(self, step: int) -> None:
        if self.check is not None:
            self.check(step)
            self.checked_at = step
        self.state.step, self.state.epoch = step, getattr(self.state.sampler, "epoch", 0)
        assert self.ckpt is not None, "save() with checkpoints off"
        with self.guard.slow_phase("checkpoint.save", nbytes=self._nbytes()):
            try:
                self.ckpt.save(self.state)
            except CheckpointSaveError as e:
                self._failed(e)
        self.saved_at = step
        self.clock.reset(step)

    def _nbytes(self) -> int:
        return tensor_nbytes(self.state.model, self.state.optimizer)

    def _failed(self, e: CheckpointSaveError) -> None:
        if self.on_error == "stop":
            raise e
        if not dist.is_initialized() or dist.get_rank() == 0:
            LOGGER.warning("%s: warning: %s Training continues (checkpoint.on_error = 'continue').", self.who, e)
