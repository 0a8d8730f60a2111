"""Preemption: finish or abandon the current step consistently, save, exit 0.

On SIGTERM (or a first SIGINT) a flag is set; the training loop asks
`should_stop()` at every optimizer-step boundary. The answer is agreed by all ranks
(an all-reduce of the flag, MAX), so every rank stops after the same step even if
the signal reached only one of them. The trainer then saves a checkpoint and exits
with status 0 so a scheduler requeues the job. A second SIGINT exits at once (130).

The vote is kept off the step's path. Each vote is an all-reduce started at one
step and read at the next, so no rank waits for the others; and where steps are short
only every `every`-th step votes, so that a vote lags the signal by about 1 % of the
grace (`VOTE_BUDGET`), at most `VOTE_EVERY_MAX` steps. A signal thus stops the job
some steps after the one it arrived in: within about 2 % of the grace, or
`VOTE_EVERY_MAX` + 1 steps if steps suddenly grow. Where a step takes 1 % of the grace
or more, every step votes and reads its own vote at once (the stop after the signal's
own step; the wait is small next to such a step). Every vote carries the slowest
rank's step time and the smallest budget, so all ranks choose the same steps.

The grace (`grace_s`) is the time from the signal to the kill: `disttrain run` gives
torchrun a `--shutdown-timeout` just above it. Optional work between the signal and
the save (an evaluation) asks `time_for(seconds)` first and is skipped when it would
eat into the time kept for the save.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

VOTE_BUDGET = 0.01
"""How long a vote may lag a signal, as a fraction of the grace: shorter steps read
their vote a step late and vote every budget / step-time steps; longer steps read it
at once."""
VOTE_EVERY_MAX = 10
"""The most steps between two votes (their spacing comes from past step times)."""


# what signal.signal takes and returns
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass
class _Vote:
    """The vote's state in one process group (a new group starts a new one)."""

    group: object
    calls: int = 0  # should_stop calls in this group, equal on every rank
    next_at: int = 1  # the call that starts the next vote
    every: int = 1
    late: bool = True  # read a vote at the call after the one that started it
    slowest: float = 0.0  # this rank's longest step since the last vote started
    last_call: float | None = None
    pending: tuple[dist.Work | None, torch.Tensor, int] | None = None  # (work, tensor, call that started it)


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
        self._previous: dict[int, _Handler] = {}
        self._vote = _Vote(group=None)
        self.regroup_agreed = False
        """After `should_stop`: whether a vote read in that call carried a rank's request to
        regroup (the same on every rank)."""

    def install(self) -> PreemptionHandler:
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
        self._vote.pending = None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested_at is not None:
            os._exit(130)  # a second Ctrl-C: the user wants out now
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def should_stop(self, regroup: bool = False) -> bool:
        """True on every rank, after the same step, when any rank got the signal.

        A collective when the process group is up (more than one rank): call it once
        per optimizer step at the same point on every rank. A call reads the vote the
        previous call started, if any, and starts one when its turn has come
        (`all_reduce(async_op=True)`), so no call waits for the other ranks unless
        steps are long (see the module's docstring). Without a group, or in a world
        of 1, the answer is this process's flag, at once.

        A vote in flight on a group that has since been destroyed (an in-memory
        recovery after a peer died) is dropped without waiting on it: it may never
        complete. A failed vote of the live group raises the collective's error, as a
        blocking all-reduce would.

        The vote also carries `regroup`, this rank's request that the group regroup (rank
        0 of a job that nodes may join, with joined slots ready: `fast_recovery.Handoff`),
        so such a job needs no collective of its own at each step. `regroup_agreed` then
        says, after the call, whether a vote read in it carried a request.
        """
        self.regroup_agreed = False
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is not self._vote.group:  # a new group: the old one's vote is never read
            self._vote = _Vote(group=group)
        if group is None or dist.get_world_size() == 1:
            self.regroup_agreed = regroup
            return self._agreed(self.requested)
        v, now = self._vote, time.monotonic()
        if v.last_call is not None:
            v.slowest = max(v.slowest, now - v.last_call)
        v.calls, v.last_call = v.calls + 1, now
        if v.pending is not None and self._read_vote():
            return self._agreed(True)
        if v.calls < v.next_at:
            return False
        self._start_vote(regroup)
        return False if v.late else self._agreed(self._read_vote())

    def _start_vote(self, regroup: bool) -> None:
        from disttrain.runtime.collectives import comm_device

        v = self._vote
        # MAX of (flag, step time, -budget, regroup): one signalled rank is enough, and every
        # rank learns the slowest step and the smallest budget, so all choose the same steps.
        vote = torch.tensor(
            [1.0 if self.requested else 0.0, v.slowest, -VOTE_BUDGET * self.grace_s, 1.0 if regroup else 0.0],
            dtype=torch.float64,
            device=comm_device(),
        )  # NCCL: CUDA
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True)
        v.pending, v.slowest = (work, vote, v.calls), 0.0  # the tensor lives until read

    def _read_vote(self) -> bool:
        v = self._vote
        if v.pending is None:
            return False  # no vote in flight (the callers read one they started)
        work, vote, started = v.pending
        v.pending = None
        if work is not None:  # (None only for a rank outside the group)
            work.wait()
        flag, slowest, neg_budget, regroup = vote.tolist()
        self.regroup_agreed = regroup > 0
        budget = -neg_budget
        v.late = slowest < budget
        # An unknown step time (the group's first vote) votes again at the next step.
        v.every = 1 if not v.late or slowest <= 0 else max(1, min(VOTE_EVERY_MAX, int(budget / slowest)))
        v.next_at = started + v.every
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
