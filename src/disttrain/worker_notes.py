"""Notes a worker leaves for the `disttrain run` that launched it, in a folder of that
launch (`NOTES_ENV`): what the launcher says at the end must be what happened.

- `user-error`: the first rank's `UserError` line. The launcher prints it once, stops
  the job and exits 2, without a torchrun restart (a restart would repeat the mistake:
  a typo, an optimizer built before wrap, a checkpoint of another world size). The
  worker does not print it and waits to be stopped, so the launcher acts before the
  agent sees an exit. A worker that starts after the note waits to be stopped too.
- `not-retried`: the first rank's failure that a retry would repeat (JSON, see
  `report_not_retried`): the program's own error (`runtime.failures`), or the same
  unclassified failure in two attempts in a row. The launcher stops the job as for a
  user error and prints the traceback, if any, then the one line, and exits with the
  record's status. Ranks that fail only because of it (their peer's connection closed)
  exit 0 at once and say nothing: their exit must not look like a failure to restart.
- `failure-<attempt>`: the signature of the first unclassified failure of an attempt,
  which the crash-loop breaker compares with the attempt before (`repeated_failure`).
- `saved-rank<N>`: the step a rank saved after a SIGTERM. The launcher says "saved"
  only when one is there.
- `finished-rank<N>-<restart>`: rank N's code ended with status 0 in that attempt; a
  peer whose collective fails afterwards names it as the cause (a return, a break or an
  exit on one rank only), not a lost machine.
- `lostpeer-rank<N>-<restart>`: rank N ended that attempt because a peer was lost (its
  own line said so): the launcher does not list it as failed, and the crash-loop
  breaker leaves its end alone.
- `step-rank<N>-r<restart>`: the step rank N is in (`mark_step`), for the crash-loop
  breaker of the process that watches it.
- `shrunk`: the world a fast-recovery job shrank to in memory and the slots it lost
  with their node (`note_shrunk`): the launcher's exit barrier waits for the agents
  left, not for the lost one, and its last line says the job went on without them.
- `restart-path`: the slot whose fast recovery ended (left out of a shrink, a generation
  that never filled) and why: its node took torchrun's restart path, and the launcher's
  last line says so.

Under fast recovery the notes that stop the job, and each `finished` one, go onto the
job's store too (`share_stops`), so that the other nodes' launchers say the same
(`elastic.job_stop`, which copies them into another node's folder: `adopt_stop`).

Beside the notes, a folder for the per-rank logs (`TRACES_ENV`): the full traceback
of a failure a rank reported in one line (`trace_file`); `disttrain run` keeps it
only when a rank wrote there.

Outside `disttrain run` (no `NOTES_ENV`, or not a torchrun worker) nothing is written
and a user error is printed as usual. Plain Python, no torch: the lowest layer.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from disttrain import json_text
from disttrain.terminal_text import shown

NOTES_ENV = "DISTTRAIN_LAUNCH_NOTES"
TRACES_ENV = "DISTTRAIN_TRACES"
USER_ERROR = "user-error"
NOT_RETRIED = "not-retried"
WAIT_S = 60.0
"""How long a worker with a user error waits for the launcher to stop the job. The
launcher acts within a poll (`launch.notes_watch.POLL_S`); the bound is long because a
worker that exits first is seen by torchrun's agent as a failure it restarts, and a
loaded machine can delay the launcher's thread by seconds."""


def _folder() -> Path | None:
    path = os.environ.get(NOTES_ENV)
    if not path or "LOCAL_RANK" not in os.environ:  # the launcher itself, or no launcher
        return None
    return Path(path)


def notes_folder() -> Path | None:
    """This launch's notes folder, in a worker of `disttrain run` (None elsewhere)."""
    return _folder()


def under_launcher() -> bool:
    """True in a worker started by `disttrain run`."""
    return _folder() is not None


def _write_once(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it exists (the first writer wins); atomic."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.link(tmp, path)
        return True
    except OSError:  # FileExistsError: another rank was first
        return False
    finally:
        tmp.unlink(missing_ok=True)


def report_user_error(name: str, error: BaseException) -> int:
    """Show a user's mistake in one line; returns the exit status, 2. Under `disttrain
    run` the line goes to the launcher (see the module) and this call waits to be
    stopped; elsewhere it is printed to stderr."""
    if write_user_error(name, error):
        wait_to_be_stopped()  # the launcher stops the job now (SIGTERM); then exit 2
    return 2


def write_user_error(name: str, error: BaseException) -> bool:
    """The note of `report_user_error` without the wait; False (and the line printed to
    stderr) outside `disttrain run`."""
    line = f"disttrain {name}: error: {shown(error, lines=True)}"  # it may quote a folder's text
    folder = _folder()
    if folder is None:
        print(line, file=sys.stderr, flush=True)
        return False
    _write_stop(folder / USER_ERROR, line)
    return True


_SHARER: list[Callable[[str, str], None]] = []
MAX_TRACEBACK_CHARS = 256 * 1024
"""A not-retried note keeps the last this many characters of its traceback."""
FINISHED = "finished"


def share_stops(send: Callable[[str, str], None] | None) -> None:
    """From now on (until `share_stops(None)`) `send(kind, text)` gets each note of this
    process that stops the job (kind `USER_ERROR` or `NOT_RETRIED`, the note's text)
    before it is written to this node's folder, unless the folder has one already, and
    each `note_finished` (kind `FINISHED`, the rank): fast recovery puts them on the
    job's store, for the other nodes (`elastic.job_stop`). A send that fails is skipped."""
    _SHARER[:] = [send] if send is not None else []


def _share(kind: str, text: str) -> None:
    for send in _SHARER:
        try:
            send(kind, text)
        except Exception:  # noqa: BLE001  (the store is gone: this node's note still holds here)
            pass


def _write_stop(path: Path, text: str) -> bool:
    """A note that stops the job: shared first (`share_stops`), so that it reaches the
    other nodes before this node's launcher acts on it; then written, the first wins."""
    if not path.exists():
        _share(path.name, text)
    return _write_once(path, text)


def adopt_stop(kind: str, text: str, folder: Path | None = None) -> bool:
    """Write a note that another node's rank shared (`share_stops`) into this node's
    folder (`folder` in the launcher itself), for its launcher, unless it has one
    already. Returns whether the note stops the job: False for a kind or a record that
    is not one (nothing written), and outside `disttrain run`."""
    folder = folder or _folder()
    if folder is None:
        return False
    if kind == USER_ERROR:
        if (folder / NOT_RETRIED).exists():
            return True
        _write_once(folder / USER_ERROR, text)
        return True
    if kind != NOT_RETRIED or _not_retried_record(text) is None:
        return False
    if not (folder / USER_ERROR).exists():
        _write_once(folder / NOT_RETRIED, text)
    return True


def _not_retried_record(text: str) -> dict | None:
    """The record of a not-retried note (`report_not_retried`), or None when `text` is
    not one: a JSON object with a line and an exit status from 1 to 255."""
    record = json_text.loads_object(text)
    if record is None or not isinstance(record.get("line"), str):
        return None
    status = record.get("status")
    return record if isinstance(status, int) and 0 < status < 256 else None


PEER_NOTE_WAIT_S = 1.0
"""How long a rank whose collective failed waits for a peer's note before it calls the
failure a lost peer: a peer that crashed in native code has its note written by the
process that saw it die, a few milliseconds after the connection closed."""


def earlier_stop(wait_s: float = 0.0) -> bool:
    """True when a rank of this launch already reported a user error or a failure that
    is not retried (in a worker at its start: a restart the launcher did not stop in
    time; after a failed collective: its peer stopped on purpose), waiting up to
    `wait_s` seconds for such a note to appear."""
    folder = _folder()
    if folder is None:
        return False
    deadline = time.monotonic() + wait_s
    # torchrun's agent stops this rank (SIGTERM) as soon as it sees the peer gone: the wait
    # must end with this rank's own line, not be cut short by it.
    with _sigterm_ignored(wait_s > 0):
        while not ((folder / USER_ERROR).exists() or (folder / NOT_RETRIED).exists()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    return True


@contextlib.contextmanager
def _sigterm_ignored(wanted: bool) -> Iterator[None]:
    """SIGTERM ignored inside the block, when `wanted` and on the main thread (where
    handlers are set); the handler before is restored after it."""
    if not wanted or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def report_not_retried(line: str, status: int, traceback: str | None = None, oom: dict | None = None) -> bool:
    """Hand the launcher a failure it must not retry: `line` (what failed, where, and
    that it is not retried), the exit status the job ends with, the `traceback` to
    print before the line, and for an out-of-memory error the facts the planner needs
    (`oom`: params, strategy, world, optimizer, precision). The first rank wins;
    returns whether this one did. The caller then waits to be stopped
    (`wait_to_be_stopped`)."""
    folder = _folder()
    if folder is None:
        return False
    if traceback is not None and len(traceback) > MAX_TRACEBACK_CHARS:
        traceback = "...\n" + traceback[-MAX_TRACEBACK_CHARS:]
    record = {"line": line, "status": status, "traceback": traceback, "oom": oom}
    return _write_stop(folder / NOT_RETRIED, json.dumps(record))


def wait_to_be_stopped() -> None:
    """After a note the launcher acts on: it stops the job now (SIGTERM), before the
    agent sees this worker exit (which it would restart). The SIGTERM ends this process
    at once: a handler installed earlier (a Job's preemption save) has nothing left to
    do, and keeping it would hold the agent until `WAIT_S` runs out."""
    with contextlib.suppress(ValueError):  # ValueError: not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(WAIT_S)


def read_not_retried(folder: str | Path) -> dict | None:
    try:
        return json.loads((Path(folder) / NOT_RETRIED).read_text())
    except (OSError, ValueError):
        return None


def repeated_failure(attempt: tuple[int, int], signature: str) -> str | None:
    """Record `signature` as attempt `attempt`'s (restart count, in-memory generation)
    first unclassified failure; return it when the attempt before ended with the same
    one (a crash loop), else None. Outside `disttrain run`: None."""
    folder = _folder()
    if folder is None:
        return None
    name = f"failure-{attempt[0]:06d}-{attempt[1]:06d}"
    _write_once(folder / name, signature)
    names = sorted(p.name for p in folder.glob("failure-*"))
    mine = names.index(name)
    if mine == 0:
        return None
    try:
        ours, before = (folder / name).read_text(), (folder / names[mine - 1]).read_text()
    except OSError:
        return None
    return ours if ours == before else None


def first_to_say(event: str) -> bool:
    """Whether this rank is the first to report `event` (a name unique to it, such as
    an attempt's lost peer), so that one line is said per event whatever the number of
    ranks that saw it. Outside `disttrain run`: True."""
    folder = _folder()
    return folder is None or _write_once(folder / f"said-{event}", "")


def trace_file(rank: int) -> Path | None:
    """This rank's log of full tracebacks under `disttrain run` (None elsewhere)."""
    path = os.environ.get(TRACES_ENV)
    return Path(path) / f"rank{rank}.log" if path and _folder() is not None else None


def _restart() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def note_finished(rank: int) -> None:
    """This rank's code ended with status 0 in this attempt (a no-op outside `disttrain
    run`): a peer whose collective then fails knows why (`finished_peers`)."""
    if _folder() is not None:
        _share(FINISHED, str(rank))
        adopt_finished(rank)


def adopt_finished(rank: int) -> None:
    """`note_finished` for a rank of another node (`share_stops`), not shared again."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / f"finished-rank{rank}-{_restart():06d}", "")


STOOD_BY = "stood-by"


def note_stood_by(slot: int) -> None:
    """Hot-spare slot `slot` ended while standing by (no roster named it): it trained
    nothing, so a stop by signal has nothing of it to save (`read_stood_by`)."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / STOOD_BY, json.dumps({"slot": slot}))


STANDBY_LOST = "standby-lost"


def note_standby_lost(slots: list[int]) -> None:
    """Hot-spare slots `slots` were lost with their node while standing by: this launch's
    exit barrier must not wait for their agents (`read_standby_lost`)."""
    folder = _folder()
    if folder is not None and slots:
        _replace(folder / STANDBY_LOST, json.dumps(sorted(slots)))


def read_standby_lost(folder: str | Path) -> list[int]:
    """The slots `note_standby_lost` names ([] without a note, or a malformed one)."""
    try:
        slots = json.loads((Path(folder) / STANDBY_LOST).read_text()[:65536])
    except (OSError, ValueError):
        return []
    return [s for s in slots if isinstance(s, int)] if isinstance(slots, list) else []


def read_stood_by(folder: str | Path) -> bool:
    """Whether a slot of this launch ended standing by (`note_stood_by`)."""
    return (Path(folder) / STOOD_BY).exists()


def note_lost_peer(rank: int) -> None:
    """This rank ends the attempt because a peer was lost, and said so in its own line
    (a no-op outside `disttrain run`): it did not fail of its own (`lost_peer_ranks`,
    `judged_lost_peer`)."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / f"lostpeer-rank{rank}-{_restart():06d}", "")


def judged_lost_peer(rank: int) -> bool:
    """Whether `rank` noted a lost peer in this attempt (`note_lost_peer`)."""
    folder = _folder()
    return folder is not None and (folder / f"lostpeer-rank{rank}-{_restart():06d}").exists()


def lost_peer_ranks(folder: str | Path) -> list[int]:
    """For the launcher after the job failed: the ranks that noted a lost peer in the
    newest attempt that noted one."""
    found: dict[int, list[int]] = {}
    for p in Path(folder).glob("lostpeer-rank*-*"):
        rank, _, restart = p.name.removeprefix("lostpeer-rank").partition("-")
        if rank.isdigit() and restart.isdigit():
            found.setdefault(int(restart), []).append(int(rank))
    return sorted(found[max(found)]) if found else []


def finished_peers(rank: int) -> list[int]:
    """The ranks other than `rank` whose code ended with status 0 in this attempt."""
    folder = _folder()
    if folder is None:
        return []
    suffix = f"-{_restart():06d}"
    names = [p.name[len("finished-rank") : -len(suffix)] for p in folder.glob(f"finished-rank*{suffix}")]
    return sorted(int(n) for n in names if n.isdigit() and int(n) != rank)


def note_hang(reporter: int, lagging: list[int]) -> None:
    """The hang watchdog's verdict (the ranks that stopped making progress), for the
    launcher's last line, which must agree with the guard's summary (a no-op outside
    `disttrain run`)."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / f"hang-{_restart():06d}", json.dumps({"reporter": reporter, "lagging": lagging}))


def read_hang(folder: str | Path) -> dict | None:
    """The newest attempt's hang verdict (`note_hang`), or None."""
    notes = sorted(Path(folder).glob("hang-*"))
    return _read_record(notes[-1]) if notes else None


def note_pace(rank: int, seconds: float) -> None:
    """`rank`'s typical step time so far, kept across the attempts of this launch, so
    that a resumed attempt's hang watchdog starts with the bound the attempt before had
    (`read_pace`). A no-op outside `disttrain run`; a failed write is skipped."""
    folder = _folder()
    if folder is not None:
        _replace(folder / f"pace-rank{rank}", repr(float(seconds)))


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, the newest writer winning; a failed write is skipped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass


def read_pace(rank: int) -> float | None:
    """The step time an earlier attempt of this launch noted for `rank` (`note_pace`)."""
    folder = _folder()
    try:
        value = float((folder / f"pace-rank{rank}").read_text()[:64]) if folder is not None else None
    except (OSError, ValueError):
        return None
    return value if value is not None and 0 < value < float("inf") else None


SHRUNK = "shrunk"


RESTART_PATH = "restart-path"


def note_shrunk(world: int, lost: list[int], spares: list[int] | tuple = (), joined: list[int] | tuple = ()) -> None:
    """A new generation of the job runs in memory at `world` ranks without the slots
    `lost` (their supervisors stopped beating: a node is gone), hot-spare slots `spares`
    in their places if any, and with the slots `joined` of nodes that joined, for the
    launcher: its exit barrier waits for the agents left, and its last line says so
    (`read_shrunk`). The newest note wins; a generation with neither (generation 0 of a
    new torchrun attempt, whole again, or one whose newcomers were refused at start:
    `fast_recovery.Handoff.refuse_newcomers`) removes the note. A no-op outside
    `disttrain run`."""
    folder = _folder()
    if folder is not None and (lost or joined):
        record = {"world": world, "lost": sorted(lost), "spares": sorted(spares), "joined": sorted(joined)}
        _replace(folder / SHRUNK, json.dumps(record))
    elif folder is not None:
        (folder / SHRUNK).unlink(missing_ok=True)


def note_restart_path(rank: int, why: str) -> None:
    """Fast recovery ended for slot `rank` (`why`: left out of a shrink, a generation
    that never filled) and its node takes torchrun's restart path, for the launcher's
    last line (`read_restart_path`). The first note wins. A no-op outside `disttrain run`."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / RESTART_PATH, json.dumps({"rank": rank, "why": why}))


def read_restart_path(folder: str | Path) -> dict | None:
    """The first `note_restart_path` of this launch: {"rank", "why"}, or None."""
    return _read_record(Path(folder) / RESTART_PATH)


def read_shrunk(folder: str | Path) -> dict | None:
    """The newest shrink or growth this launch's ranks noted (`note_shrunk`): {"world",
    "lost", "spares", "joined"}, or None."""
    return _read_record(Path(folder) / SHRUNK)


def _read_record(path: Path) -> dict | None:
    """The JSON object a note holds, or None (no note, or not an object)."""
    try:
        return json_text.loads_object(path.read_text())
    except OSError:
        return None


def failed_attempts(folder: str | Path) -> int:
    """The failed attempts this launch went on from: each attempt's failure a rank
    reported (`failure-*`, `said-failure-*`) and each spare take-over (`said-promotion-*`)."""
    names = {p.name for p in Path(folder).glob("*") if p.name.startswith(("failure-", "said-"))}
    attempts = {n.removeprefix("said-") for n in names if n.removeprefix("said-").startswith("failure-")}
    return len(attempts) + sum(1 for n in names if n.startswith("said-promotion-"))


_BOARD: dict[str, int] = {}
"""The open step file of this process (`mark_step`), by its path."""


def _step_file(rank: int) -> Path | None:
    """`rank`'s step file for this torchrun attempt: a new attempt starts with none, so
    a death before its first step is never taken for one at the step of the attempt
    before."""
    folder = _folder()
    return None if folder is None else folder / f"step-rank{rank}-r{_restart()}"


def mark_step(step: int, run: str = "") -> None:
    """Step `step` of the run whose checkpoints live in `run` begins on this rank:
    marked for the process that watches it (the stub, or the slot supervisor under fast
    recovery), whose crash-loop breaker compares the steps of two deaths in a row
    (`read_mark`); a script that runs several jobs one after the other has one step
    count per job. One `pwrite` of 28 bytes per step into a file opened once; nothing
    outside `disttrain run`."""
    path = _step_file(int(os.environ.get("RANK", "0")))
    if path is None:
        return
    fd = _BOARD.get(str(path))
    if fd is None:
        flags = os.O_CREAT | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
        fd = _BOARD[str(path)] = os.open(path, flags, 0o600)
    os.pwrite(fd, b"%012d" % step + _run_key(run), 0)


@functools.cache
def _run_key(run: str) -> bytes:
    """16 bytes naming the run `run` on the step file: hashed once per run, not per step."""
    return (hashlib.sha256(run.encode()).hexdigest()[:16] if run else "-" * 16).encode()


def read_mark(rank: int) -> tuple[int, str] | None:
    """The step `rank`'s training process last marked in this torchrun attempt
    (`mark_step`) and a key of the run it belongs to, or None: none marked (outside
    `dt.Job`, before its first step), or outside `disttrain run`."""
    path = _step_file(rank)
    try:
        raw = path.read_bytes()[:28] if path is not None else b""
        return (int(raw[:12]), raw[12:].decode("ascii", "replace")) if raw else None
    except (OSError, ValueError):
        return None


def read_step(rank: int) -> int | None:
    """The step of `read_mark`, or None."""
    mark = read_mark(rank)
    return None if mark is None else mark[0]


def note_saved(rank: int, step: int) -> None:
    """After a preemption's save on `rank` (a no-op outside `disttrain run`)."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / f"saved-rank{rank}", str(step))


def read_stop(folder: str | Path) -> tuple[str, str] | None:
    """The note that stops the job, as `share_stops` sends it (kind, text): a user error
    first, else a failure not retried; None when there is neither."""
    for kind in (USER_ERROR, NOT_RETRIED):
        try:
            return kind, (Path(folder) / kind).read_text()
        except OSError:
            continue
    return None


def read_user_error(folder: str | Path) -> str | None:
    try:
        return (Path(folder) / USER_ERROR).read_text().strip() or None
    except OSError:
        return None


def read_saved(folder: str | Path) -> int | None:
    """The step the ranks saved after a SIGTERM (the lowest reported), or None."""
    steps = []
    for f in Path(folder).glob("saved-rank*"):
        try:
            steps.append(int(f.read_text()))
        except (OSError, ValueError):
            continue
    return min(steps) if steps else None
