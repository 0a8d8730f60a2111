"""Preemption: finish or abandon the current step consistently, save, exit 0.

On SIGTERM (or a first SIGINT) a flag is set; the training loop asks
`should_stop()` at every optimizer-step boundary. The answer is agreed by all ranks
(an all-reduce of the flag, MAX), so every rank stops after the same step even if
the signal reached only one of them. The trainer then saves a checkpoint and exits
with status 0 so a scheduler requeues the job. A second SIGINT exits at once (130).

The vote is asynchronous so that it costs no wait: the all-reduce started at step s
runs behind step s+1's work and is read at step s+1, where every rank gets the same
answer. A signal therefore stops the job after the step that follows the one it
arrived in (at most two optimizer steps after it), not after the step it arrived in.

The grace (`grace_s`) is the time from the signal to the kill: `disttrain run` gives
torchrun a `--shutdown-timeout` just above it. It must hold two steps and the save.
Optional work between the signal and the save (an evaluation) asks `time_for(seconds)`
first and is skipped when it would eat into the time kept for the save.
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
        # (work, flag tensor, group) of the vote in flight, read by the next should_stop
        self._pending: tuple | None = None

    def install(self) -> "PreemptionHandler":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers and drop a vote in flight without waiting on
        it: after a peer's loss it may never complete; after a normal end every rank
        started it, so the group completes it before it is destroyed."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._pending = None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested_at is not None:
            os._exit(130)  # a second Ctrl-C: the user wants out now
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def should_stop(self) -> bool:
        """True on every rank, after the same step, when any rank got the signal.

        A collective when the process group is up (more than one rank): call it once
        per optimizer step at the same point on every rank. It reads the vote started
        by the previous call and starts the next one (`all_reduce(async_op=True)`), so
        the answer is one call late and no call waits for the other ranks. The first
        call with a group, and the first after a new group, answer False. Without a
        group, or in a world of 1, the answer is this process's flag, at once.

        A vote pending on a group that has since been destroyed (an in-memory recovery
        after a peer died) is dropped without waiting on it: it may never complete.
        A failed vote of the live group raises the collective's error, as a blocking
        all-reduce would.
        """
        group = dist.group.WORLD if dist.is_initialized() else None
        agreed = False
        if self._pending is not None:
            work, flag, voted_in = self._pending
            self._pending = None
            if voted_in is group:
                work.wait()
                agreed = bool(flag.item())
        if group is None or dist.get_world_size() == 1:
            agreed = agreed or self.requested
        elif not agreed:
            self._start_vote(group)
        if agreed and self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal_name = "peer"
        return agreed

    def _start_vote(self, group) -> None:
        from disttrain.runtime.collectives import comm_device

        # On the device the backend moves (NCCL: CUDA); MAX: one signalled rank is enough.
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=comm_device())
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (work, flag, group)  # the work and its tensor live until read

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
