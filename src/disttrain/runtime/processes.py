"""Process plumbing, written once: the parent-death signal and the process's name
(Linux `prctl(2)` through ctypes; a no-op elsewhere), freezing the garbage collector
(`freeze_long_lived`, `thaw_long_lived`), and `STATE`, the one registry of what
describes this process (its group, its handles, its once-only flags; defined in
process_state.py, which log.py reads as well).

No other module of the package calls `prctl`, `gc.freeze` or `gc.unfreeze`, or keeps a
`global` of its own (tests/faults/test_processes.py checks the source); a module that needs a
process-wide value reads and writes its field of `STATE`.

Each process of a `disttrain run` job names itself: the kernel's process name (`comm`,
at most 15 bytes), which `ps -e`, `ps -o pid,comm`, `top`, `pgrep` and
/proc/PID/comm show:

    rank1.local0     a training process: global rank 1, local rank 0
    stub.rank1       a warm-worker stub, the process torchrun watches for rank 1
                     (launch/warm_workers.py; killing it kills rank 1's training process)
    slot.rank1       a fast-recovery slot supervisor (launch/slot_supervisor.py)
    spare.rank1      its warm spare, until it takes over (then rankR.localL)
    dt.warm-server   the warm server that forks the workers

A training process also says its pid once, at start, through the disttrain logger
("rank 1 (local rank 0) is pid 4242"), so a rank can be signalled by hand. Imports
nothing heavy: the launcher and the stubs use it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys

from disttrain.runtime.log import EVERY_RANK, LOGGER
from disttrain.runtime.process_state import STATE, first_time

__all__ = [
    "STATE",
    "die_with_parent",
    "first_time",
    "freeze_long_lived",
    "name_for",
    "name_worker",
    "set_name",
    "thaw_long_lived",
]

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NAME_BYTES = 15
"""The kernel keeps 16 bytes of a process name, the last one its NUL."""
ROLE_ENV = "DISTTRAIN_FAST_ROLE"
"""elastic.fast_recovery.ROLE_ENV (not imported: that imports torch): 'spare' names a
warm spare."""


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


def name_worker(
    role: str = "rank", *, rank: int | None = None, local_rank: int | None = None, announce: str = ""
) -> str:
    """Name this worker from its rank (the arguments, else torchrun's RANK and
    LOCAL_RANK); a warm spare (ROLE_ENV 'spare') is named as one. With `announce` (the
    speaker, e.g. 'disttrain run'), a training process also prints its pid once on
    stderr. Returns the name ('' outside torchrun, where nothing is named)."""
    rank_s = os.environ.get("RANK", "") if rank is None else str(rank)
    local_s = os.environ.get("LOCAL_RANK", "0") if local_rank is None else str(local_rank)
    if rank_s == "":
        return ""
    if role == "rank" and os.environ.get(ROLE_ENV) == "spare":
        role, announce = "spare", ""
    name = name_for(role, rank_s, local_s)
    set_name(name)
    if announce and role == "rank" and STATE.announced_pid != os.getpid():
        STATE.announced_pid = os.getpid()
        LOGGER.info(f"{announce}: rank {rank_s} (local rank {local_s}) is pid {os.getpid()} ({name})", extra=EVERY_RANK)
    return name


def freeze_long_lived(*, for_life: bool = False) -> None:
    """Move every object alive now to the collector's permanent generation (`gc.freeze`):
    call after imports that the process keeps for its whole life (torch at `init`, DCP
    at the first `Checkpointer`). Undone by `thaw_long_lived` (process_group.shutdown),
    unless `for_life` (a warm worker's server, a fast-recovery rank) or the process was
    frozen before the first such call: then frozen for life, on purpose.

    Why: a full automatic collection scans every tracked object, about 250,000 in a
    process with torch and DCP imported (a million in a warm server), which took
    0.2-0.3 s on 2 cores. It ran about every fourth checkpoint load, on whichever rank
    allocated at that moment, and the other ranks waited for it in the load's next
    collective. Frozen objects are never scanned, and a forked child leaves the pages
    they share unwritten.

    What it hides: a frozen object is never collected (cyclic garbage among them is
    freed only after a thaw), and it is absent from `gc.get_objects()` and from any
    check that finds objects through the collector. So no check of the package may find
    objects that way: the optimizer-built-before-wrap check (train/optimizer_order.py) numbers
    each optimizer when it is built instead, and sees one built before a freeze."""
    if for_life:
        STATE.thaw_at_shutdown = False  # an earlier freeze is now for life as well
    elif not STATE.frozen and gc.get_freeze_count() == 0:  # (the count walks every frozen object)
        STATE.thaw_at_shutdown = True  # the first freeze is ours: nothing else counts on it
    gc.freeze()
    STATE.frozen = True


def thaw_long_lived() -> bool:
    """Give what `freeze_long_lived` froze back to the collector (`gc.unfreeze`), unless
    the process is frozen for life (see there). Returns whether it thawed."""
    if not STATE.thaw_at_shutdown:
        return False
    STATE.thaw_at_shutdown = STATE.frozen = False
    gc.unfreeze()
    return True
