"""What the checks say: one message per finding on rank 0, a stop for a bug that makes
the results wrong, and the summary of what was checked.

Every rank decides on the same gathered numbers, so every rank reaches the same
verdict at the same step: rank 0 speaks, and for a stop every rank exits
`STOP_STATUS`. Under `disttrain run` the stop goes through the launcher's notes
(`worker_notes.report_not_retried`): the launcher prints the message once, last, stops
the job and exits 3, with no restart (the bug would repeat). Elsewhere rank 0 prints it.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from disttrain import worker_notes
from disttrain.runtime.log import LOGGER

STOP_STATUS = 3
"""The exit status of a run stopped by a check (a bug that makes its results wrong)."""
PREFIX = "--check"


@dataclass(frozen=True)
class Finding:
    """One bug or warning: `check` names the check ("replicas", "gradients", "data",
    "wrapping", "numbers", "saves", "rng", "precision"), `stops` whether the results are
    wrong (exit 3) rather than slow or fragile (a warning), `text` the whole message: the
    bug in the user's words, the ranks, the step, the user's line where one applies, and
    the fix."""

    check: str
    stops: bool
    text: str


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """Folders whose frames are never the user's line: torch, disttrain, the stdlib."""
    import torch

    dirs = [Path(torch.__file__).parent, Path(__file__).parents[1], Path(sysconfig.get_paths()["stdlib"])]
    return tuple(str(d.resolve()) + os.sep for d in dirs)


@functools.lru_cache(maxsize=1024)
def own_code(filename: str) -> bool:
    """Whether code of `filename` (a code object's) is torch's, disttrain's or the
    standard library's, never the user's line."""
    return os.path.realpath(filename).startswith(_own_dirs())


def users_file(name: str) -> bool:
    """Whether a frame's file `name` is the user's code: a real file outside torch,
    disttrain and the standard library."""
    return not name.startswith("<") and not own_code(name)


def user_line(frame: FrameType | None = None) -> str | None:
    """'file:line' of the innermost frame of the caller's stack (or of `frame`'s) that
    is the user's code (not torch, disttrain or the standard library), the path relative
    to the working folder when it lies inside it; None when there is none."""
    frame = frame or inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if users_file(name):
            path = os.path.realpath(name)
            try:
                shown = os.path.relpath(path)
            except ValueError:  # another drive (Windows)
                shown = path
            return f"{path if shown.startswith('..') else shown}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def past_checks(frame: FrameType | None) -> FrameType | None:
    """`frame`, or the first frame up the stack from it that is not one of the checks'
    own wrappers (two checks may wrap the same function: the inner one's caller is the
    outer wrapper, and the caller that counts is the one above it)."""
    checks = str(Path(__file__).parent.resolve()) + os.sep
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(checks):
        frame = frame.f_back
    return frame


def called_by_user(depth: int = 2) -> bool:
    """Whether the function `depth` frames up the stack from this one was called by the
    user's code directly (a wrapper asks with depth 2: its caller's caller is not torch,
    disttrain or the standard library calling on its own behalf; the checks' own
    wrappers in between are skipped)."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    frame = past_checks(frame)
    return frame is not None and users_file(frame.f_code.co_filename)


def ranks_text(ranks: list[int]) -> str:
    """'rank 1 differs from rank 0' / 'ranks 1, 3 differ from rank 0'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} differs from rank 0"
    return f"ranks {', '.join(map(str, ranks))} differ from rank 0"


@dataclass
class Report:
    """The findings of this rank's checks and what each check covered (`notes`)."""

    found: list[Finding] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    said: set[str] = field(default_factory=set)

    def note(self, check: str, text: str) -> None:
        """What `check` covered so far, for the summary (the newest text wins)."""
        self.notes[check] = text

    def add(self, finding: Finding | None, key: str | None = None) -> None:
        """Say `finding` once per `key` (default: its check): a warning on rank 0, or a
        stop (see the module; never returns)."""
        if finding is None or (key or finding.check) in self.said:
            return
        self.said.add(key or finding.check)
        self.found.append(finding)
        if finding.stops:
            stop(finding.text)
        LOGGER.warning(f"disttrain {PREFIX} warning: {finding.text}")

    def summary(self, steps: int, boundary: bool, world: int) -> str:
        """The closing line: the steps and epoch boundary checked on `world` ranks, what
        each check covered, and the count of warnings (a stop never gets here)."""
        what = f"{steps} optimizer step{'s' if steps != 1 else ''}"
        if boundary:
            what += " and an epoch boundary"
        covered = "; ".join(f"{check}: {text}" for check, text in sorted(self.notes.items()))
        warned = len(self.found)
        verdict = f"{warned} warning{'s' if warned != 1 else ''} above" if warned else "no problem found"
        return f"disttrain {PREFIX}: checked {what} on {world} rank{'s' if world != 1 else ''} ({covered}): {verdict}."


def stop(text: str, speaker: int = 0) -> None:
    """End the run for a bug that makes its results wrong: the message once (by rank
    `speaker`, one of the ranks that found it), exit `STOP_STATUS` on every rank. Never
    returns."""
    rank = int(os.environ.get("RANK", "0") or 0)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if worker_notes.under_launcher():
        try:  # the launcher's SIGTERM ends this process at once (no preemption save of wrong results)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread: the wait below ends it
            pass
        if rank == speaker:
            worker_notes.report_not_retried(f"{PREFIX} stopped the run: {text}", STOP_STATUS)
        worker_notes.wait_to_be_stopped()  # the launcher stops every rank now
    elif rank == speaker:
        print(f"disttrain {PREFIX} stopped the run (exit status {STOP_STATUS}): {text}", file=sys.stderr, flush=True)
    os._exit(STOP_STATUS)
