"""The bound on a worker's exit once the user's code has finished.

After the script or module returns, the process still joins its non-daemon threads and
runs its atexit functions; a thread that never ends, or a destructor that waits on a
thread that needs the GIL, would keep the rank (and the job) alive forever, silently.
`arm` starts faulthandler's timer, a native thread that needs no GIL: past the bound it
writes every thread's Python stack to the rank's log and ends the process (status 1).
`arm` first leaves a note (`exiting-<pid>` in the launch's notes folder), so the process
that watches this one (the warm worker's stub) tells such an end from a failure: the
script had finished, so the rank ends with status 0 and one line that says where its
exit was stuck. `disarm` removes both once the exit went through.

The bound is DISTTRAIN_EXIT_BOUND_S seconds (default 30: long enough for a tracker's
final upload at exit); 0 turns it off. Plain Python: the stub uses it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from disttrain import worker_notes

BOUND_ENV = "DISTTRAIN_EXIT_BOUND_S"
DEFAULT_BOUND_S = 30.0
NOTE_PREFIX = "exiting-"


def bound_s() -> float:
    """The bound in force (DISTTRAIN_EXIT_BOUND_S; a value that is no number: the default)."""
    try:
        return max(0.0, float(os.environ.get(BOUND_ENV) or DEFAULT_BOUND_S))
    except ValueError:
        return DEFAULT_BOUND_S


def _note(pid: int) -> Path | None:
    folder = worker_notes.notes_folder()
    return None if folder is None else folder / f"{NOTE_PREFIX}{pid}"


def arm(status: int) -> bool:
    """After the user's code, which ended with `status`: end this process `bound_s()`
    seconds from now unless `disarm` comes first. Returns whether it was armed (under
    `disttrain run`, with a rank log for the stack, and a bound above 0)."""
    import faulthandler

    note, bound = _note(os.getpid()), bound_s()
    rank = os.environ.get("RANK", "")
    log = worker_notes.trace_file(int(rank)) if rank.isdigit() else None
    if note is None or log is None or bound <= 0:
        return False
    stream = open(log, "a")  # noqa: SIM115  (faulthandler writes to it at the bound; the process then ends)
    note.write_text(f"{status}\n{log}")
    faulthandler.dump_traceback_later(bound, exit=True, file=stream)
    return True


def end_process(code: int) -> NoReturn:
    """A watched worker's end once its code returned with `code`: what the interpreter
    does at exit (join non-daemon threads, run atexit functions) bounded by `arm`, then
    `os._exit(code)` without the teardown of every module (torch's takes about 0.9 s,
    which a restart would wait for)."""
    import sys

    from disttrain.runtime.torch_compat import finish_interpreter

    armed = arm(code)
    finish_interpreter()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if armed:
        disarm()
    os._exit(code)


def disarm() -> None:
    """The exit went through: cancel the timer and remove the note."""
    import faulthandler

    faulthandler.cancel_dump_traceback_later()
    note = _note(os.getpid())
    if note is not None:
        note.unlink(missing_ok=True)


def stuck_exit(pid: int) -> tuple[int, str] | None:
    """For the process that watched `pid` end with status 1: when `pid` was ended at
    the bound after its code had finished, the status its code ended with and the rank
    log that holds its stack; None when it failed otherwise (no note)."""
    note = _note(pid)
    if note is None:
        return None
    try:
        status, log = note.read_text().split("\n", 1)
    except (OSError, ValueError):
        return None
    note.unlink(missing_ok=True)
    return int(status), log
