"""Process plumbing (Linux `prctl(2)` through ctypes; a no-op elsewhere): a signal when
the parent dies, and a name that says what the process is.

Each process of a `disttrain run` job names itself: the kernel's process name (`comm`,
at most 15 bytes), which `ps -e`, `ps -o pid,comm`, `top`, `pgrep` and
/proc/PID/comm show:

    rank1.local0     a training process: global rank 1, local rank 0
    stub.rank1       a warm-worker stub, the process torchrun watches for rank 1
                     (launch/warm_workers.py; killing it kills rank 1's training process)
    slot.rank1       a fast-recovery slot supervisor (launch/slot_supervisor.py)
    spare.rank1      its warm spare, until promoted (then rankR.localL)
    dt.warm-server   the warm-worker server that forks the workers

A training process also says its pid once, at start, through the disttrain logger
("rank 1 (local rank 0) is pid 4242"), so a rank can be signalled by hand. Imports
nothing heavy: the launcher and the stubs use it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from disttrain.runtime.log import EVERY_RANK, LOGGER

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NAME_BYTES = 15
"""The kernel keeps 16 bytes of a process name, the last one its NUL."""
ROLE_ENV = "DISTTRAIN_FAST_ROLE"
"""elastic.fast_recovery.ROLE_ENV (not imported: that imports torch): 'spare' names a
warm spare."""

_announced: int | None = None  # the pid that said its rank (a fork is a new process)


def _prctl(option: int, arg) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies
    (PR_SET_PDEATHSIG). Returns whether the request took effect (False off Linux)."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def set_name(name: str) -> bool:
    """Name this process `name` (cut to 15 bytes) in ps, top and /proc/PID/comm."""
    return _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:NAME_BYTES]))


def name_for(role: str, rank: int | str, local_rank: int | str = 0) -> str:
    """The name of a job's process: `rankR.localL` for role 'rank' (a training
    process), else `ROLE.rankR` ('stub', 'slot', 'spare')."""
    return f"rank{rank}.local{local_rank}" if role == "rank" else f"{role}.rank{rank}"


def name_worker(role: str = "rank", *, rank: int | None = None, local_rank: int | None = None,
                announce: str = "") -> str:
    """Name this worker from its rank (the arguments, else torchrun's RANK and
    LOCAL_RANK); a warm spare (ROLE_ENV 'spare') is named as one. With `announce` (the
    speaker, e.g. 'disttrain run'), a training process also prints its pid once on
    stderr. Returns the name ('' outside torchrun, where nothing is named)."""
    global _announced
    rank = os.environ.get("RANK", "") if rank is None else rank
    local_rank = os.environ.get("LOCAL_RANK", "0") if local_rank is None else local_rank
    if rank == "":
        return ""
    if role == "rank" and os.environ.get(ROLE_ENV) == "spare":
        role, announce = "spare", ""
    name = name_for(role, rank, local_rank)
    set_name(name)
    if announce and role == "rank" and _announced != os.getpid():
        _announced = os.getpid()
        LOGGER.info(f"{announce}: rank {rank} (local rank {local_rank}) is pid {os.getpid()} ({name})",
                    extra=EVERY_RANK)
    return name
