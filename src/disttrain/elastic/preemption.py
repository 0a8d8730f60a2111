"""Preemption: finish or abandon the current step consistently, save, exit 0.

On SIGTERM (or a first SIGINT) a flag is set; the training loop asks
`should_stop()` at every optimizer-step boundary. The answer is agreed by all ranks
(one all-reduce of the flag, MAX), so every rank stops after the same step even if
the signal reached only one of them. The trainer then saves a checkpoint and exits
with status 0 so a scheduler requeues the job. A second SIGINT exits at once (130).

The grace (`grace_s`) is the time from the signal to the kill: `disttrain run` gives
torchrun a `--shutdown-timeout` just above it. Optional work between the signal and
the save (an evaluation) asks `time_for(seconds)` first and is skipped when it would
eat into the time kept for the save.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


class PreemptionHandler:
    """Installs the handlers on `install()`; restores the previous ones on `uninstall()`."""

    def __init__(self, grace_s: float | None = None, *, save_reserve: float = 0.5):
        """`grace_s`: seconds from the signal to the kill; None reads
        DISTTRAIN_PREEMPT_GRACE_S (set by `disttrain run`), else 60. `save_reserve`: the
        fraction of the grace that optional work must leave for the save."""
        if grace_s is None:
            grace_s = float(os.environ.get("DISTTRAIN_PREEMPT_GRACE_S") or 60.0)
        self.grace_s, self.save_reserve = grace_s, save_reserve
        self.requested_at: float | None = None
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptionHandler":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested_at is not None:
            os._exit(130)  # a second Ctrl-C: the user wants out now
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def should_stop(self) -> bool:
        """True on every rank when any rank got the signal. A collective when the
        process group is up: call it at the same point on every rank."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal_name = "peer"
        return bool(flag.item())

    def time_left(self) -> float:
        """Seconds left of the grace period (inf before any signal)."""
        if self.requested_at is None:
            return float("inf")
        return self.grace_s - (time.monotonic() - self.requested_at)

    def time_for(self, seconds: float) -> bool:
        """Whether optional work of about `seconds` still fits before the save.

        True when no rank has been signalled; otherwise True only if the least time
        left on any rank, minus `seconds`, still keeps `save_reserve` x the grace for
        the save. A collective when the process group is up (one all-reduce, MIN):
        every rank gets the same answer, so all skip or all run the work.
        """
        from disttrain.runtime.collectives import comm_device

        left = torch.tensor([min(self.time_left(), 1e30)], dtype=torch.float64)
        if dist.is_initialized():
            left = left.to(comm_device())
            dist.all_reduce(left, op=dist.ReduceOp.MIN)
        return float(left.item()) - seconds >= self.save_reserve * self.grace_s
