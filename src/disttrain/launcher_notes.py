"""Notes a worker leaves for the `disttrain run` that launched it, in a folder of that
launch (`NOTES_ENV`): what the launcher says at the end must be what happened.

- `user-error`: the first rank's `UserError` line. The launcher prints it once, stops
  the job and exits 2, without a torchrun restart (a restart would repeat the mistake:
  a typo, an optimizer built before wrap, a checkpoint of another world size). The
  worker does not print it and waits to be stopped, so the launcher acts before the
  agent sees an exit. A worker of a restart that slipped through exits 2 at its start.
- `saved-rank<N>`: the step a rank saved after a SIGTERM. The launcher says "saved"
  only when one is there.

Outside `disttrain run` (no `NOTES_ENV`, or not a torchrun worker) nothing is written
and a user error is printed as usual. Plain Python, no torch: the lowest layer.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

NOTES_ENV = "DISTTRAIN_LAUNCH_NOTES"
USER_ERROR = "user-error"
WAIT_S = 10.0
"""How long a worker with a user error waits for the launcher to stop the job."""


def _folder() -> Path | None:
    path = os.environ.get(NOTES_ENV)
    if not path or "LOCAL_RANK" not in os.environ:  # the launcher itself, or no launcher
        return None
    return Path(path)


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
    line = f"disttrain {name}: error: {error}"
    folder = _folder()
    if folder is None:
        print(line, file=sys.stderr, flush=True)
        return 2
    _write_once(folder / USER_ERROR, line)
    time.sleep(WAIT_S)  # the launcher stops the job now (SIGTERM); then exit 2
    return 2


def earlier_user_error() -> bool:
    """In a worker at its start: True when a rank of this launch already reported a
    user error (this worker is a restart the launcher did not stop in time)."""
    folder = _folder()
    return folder is not None and (folder / USER_ERROR).exists()


def note_saved(rank: int, step: int) -> None:
    """After a preemption's save on `rank` (a no-op outside `disttrain run`)."""
    folder = _folder()
    if folder is not None:
        _write_once(folder / f"saved-rank{rank}", str(step))


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
