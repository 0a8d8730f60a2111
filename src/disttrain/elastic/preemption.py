"""Preemption: finish or abandon the current step consistently, save, exit 0.

On SIGTERM (or a first SIGINT) a flag is set; the training loop asks
`should_stop()` at every optimizer-step boundary. The answer is agreed by all ranks
(an all-reduce of the flag, MAX), so every rank stops after the same step even if
the signal reached only one of them. The trainer then saves a checkpoint and exits
with status 0 so a scheduler requeues the job. A second SIGINT exits at once (130).

The vote costs no wait where steps are short: the all-reduce started at step s runs
behind step s+1's work and is read at step s+1, so a signal stops the job one step
later than it arrived. Where a step takes 1 % of the grace or more (a step more
would eat into it), the vote is read where it is started: the stop comes after the
step the signal arrived in, and the wait is small next to the step. Every vote
carries the slowest rank's step time, so all ranks switch between the two at the
same step.

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

# Steps shorter than this fraction of the grace read their vote a step later (no wait);
# longer ones read it at once, as one more step before the stop would cost the grace.
ASYNC_BELOW = 0.01


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
        # The vote's state in one group: the vote in flight (work, tensor), whether votes
        # are read a step late (agreed by the last vote read), the last call's time.
        self._group: object | None = None
        self._pending: tuple | None = None
        self._late, self._last_call = True, None

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
        per optimizer step at the same point on every rank. Each call starts one vote
        (`all_reduce(async_op=True)`). With short steps it returns the answer of the
        previous call's vote, so no call waits for the other ranks and the first call
        in a group answers False; with steps of `ASYNC_BELOW` x the grace or more it
        waits for its own vote. Without a group, or in a world of 1, the answer is this
        process's flag, at once.

        A vote in flight on a group that has since been destroyed (an in-memory
        recovery after a peer died) is dropped without waiting on it: it may never
        complete. A failed vote of the live group raises the collective's error, as a
        blocking all-reduce would.
        """
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not self._group:  # a new group: start as a new handler would
            self._group, self._pending, self._late, self._last_call = group, None, True, None
        if group is None or dist.get_world_size() == 1:
            return self._agreed(self.requested)
        now = time.monotonic()
        step_s = 0.0 if self._last_call is None else now - self._last_call
        self._last_call = now
        if self._pending is not None and self._read_vote():
            return self._agreed(True)
        self._start_vote(step_s)
        return False if self._late else self._agreed(self._read_vote())

    def _start_vote(self, step_s: float) -> None:
        from disttrain.runtime.collectives import comm_device

        # MAX of (flag, step time, -limit): one signalled rank is enough, and every rank
        # learns the slowest step and the smallest limit, so all choose the same mode.
        vote = torch.tensor([1.0 if self.requested else 0.0, step_s, -ASYNC_BELOW * self.grace_s],
                            dtype=torch.float64, device=comm_device())  # NCCL: CUDA
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (work, vote)  # the tensor lives until the vote is read

    def _read_vote(self) -> bool:
        work, vote = self._pending
        self._pending = None
        work.wait()
        flag, slowest, neg_limit = vote.tolist()
        self._late = slowest < -neg_limit
        return flag > 0

    def _agreed(self, stop: bool) -> bool:
        if stop and self.requested_at is None:
            self.requested_at = time.monotonic()
            self.signal_name = "peer"
        return stop

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
