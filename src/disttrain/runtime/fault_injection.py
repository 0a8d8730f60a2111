"""Fault injection as a library feature, so users can test their own jobs.

A fault is "ACTION@PHASE:key=value,...", several separated by ';', given in the
environment variable DISTTRAIN_FAULT or with `set_faults()`:

    DISTTRAIN_FAULT="kill@backward:rank=1,step=7"       SIGKILL rank 1 in step 7's backward
    DISTTRAIN_FAULT="stop@forward:rank=0,step=3"        SIGSTOP (a stall) rank 0
    DISTTRAIN_FAULT="exit@step:step=5,code=3"           every rank exits 3 before step 5's update

Actions: kill (SIGKILL), stop (SIGSTOP), term (SIGTERM, a preemption), exit (status
`code`, default 1), raise (RuntimeError), enospc (OSError ENOSPC, a full disk),
delay (sleep `ms` milliseconds: a slow rank; it fires in every restart and is silent).
Phases (`PHASES`, the one list) are the points where disttrain calls `inject`:
forward, backward, step (optimizer), and the checkpoint phases checkpoint.shards,
checkpoint.after_shards and checkpoint.during_commit (see
disttrain.checkpoint.fault_points), and recovery (an in-memory recovery's state hand-off,
`elastic.fast_recovery`; its step is the one handed over; -1 when none is) and buddy
(the buddy copy of a step's shards, posted and in flight). An unknown action or phase
is a `UserError`. Keys: rank (default any), step (default any), restart (the attempt it
fires in: TORCHELASTIC_RESTART_COUNT plus the in-memory recoveries of
`elastic.fast_recovery` so far; default 0, so a restarted or recovered job does not
fail again at the same point).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

from disttrain.errors import UserError
from disttrain.runtime import processes
from disttrain.runtime.log import EVERY_RANK, LOGGER

ACTIONS = ("kill", "stop", "term", "exit", "raise", "enospc", "delay")
PHASES = (
    "forward",
    "backward",
    "step",
    "checkpoint.shards",
    "checkpoint.after_shards",
    "checkpoint.during_commit",
    "recovery",
    "buddy",
)
"""Every point where disttrain calls `inject`: the trainer's, then the checkpoint
writer's (disttrain.checkpoint.fault_points). A new fault point is added here, so a
spec naming it is accepted; any other phase is refused, so a typo cannot make a
crash test pass without its crash."""


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    rank: int | None = None
    step: int | None = None
    restart: int = 0
    code: int = 1
    ms: int = 0


def parse(spec: str) -> list[Fault]:
    """Parse a fault spec. Raises `UserError` naming the bad part and the valid words
    (an unknown action or phase, a missing '@', a bad key or a non-integer value)."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        head, _, tail = part.partition(":")
        action, _, phase = head.partition("@")
        if not phase:
            raise UserError(
                f"fault {part!r}: write ACTION@PHASE[:key=value,...] with ACTION one of "
                f"{', '.join(ACTIONS)}, e.g. kill@backward:rank=1,step=7."
            )
        if action not in ACTIONS:
            raise UserError(f"fault {part!r}: unknown action {action!r}; use one of {', '.join(ACTIONS)}.")
        if phase not in PHASES:
            raise UserError(f"fault {part!r}: unknown phase {phase!r}; use one of {', '.join(PHASES)}.")
        keys = {}
        for item in filter(None, tail.split(",")):
            key, _, value = item.partition("=")
            if key not in ("rank", "step", "restart", "code", "ms") or not value.lstrip("-").isdigit():
                raise UserError(
                    f"fault {part!r}: bad key {item!r}; keys are rank, step, restart, ms, code with integer values."
                )
            keys[key] = int(value)
        faults.append(Fault(action=action, phase=phase, **keys))
    return faults


def set_attempt(n: int) -> None:
    """The in-memory recoveries so far (the fast-recovery generation), added to
    TORCHELASTIC_RESTART_COUNT when a fault's `restart` is matched."""
    processes.STATE.attempt = n


def attempt() -> int:
    """The in-memory recoveries so far (see `set_attempt`)."""
    return processes.STATE.attempt


def set_faults(spec: str | None) -> None:
    """Replace the active faults (None: read DISTTRAIN_FAULT again on next use)."""
    processes.STATE.faults = None if spec is None else parse(spec)


def active() -> list[Fault]:
    if processes.STATE.faults is None:
        processes.STATE.faults = parse(os.environ.get("DISTTRAIN_FAULT", ""))
    return processes.STATE.faults


def inject(phase: str, step: int, rank: int | None = None) -> None:
    """Fire every active fault that matches (phase, step, rank, restart count)."""
    faults = active()
    if not faults:
        return
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + processes.STATE.attempt
    for f in faults:
        if f.phase != phase or f.rank not in (None, rank) or f.step not in (None, step):
            continue
        if f.action == "delay":  # a slow rank, in every attempt
            time.sleep(f.ms / 1000)
            continue
        if f.restart != restart:
            continue
        LOGGER.warning(f"disttrain fault: {f.action} at {phase}, step {step}, rank {rank}", extra=EVERY_RANK)
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif f.action == "exit":
            sys.stdout.flush()
            os._exit(f.code)
        elif f.action == "enospc":  # a full disk, for checkpoint writes
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {phase})")
        else:
            raise RuntimeError(f"injected fault at {phase}, step {step}, rank {rank}")
