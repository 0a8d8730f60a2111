"""Where the watchdog's side channel lives, and how its files are opened.

The side channel holds heartbeats that name process ids, a `stall` file that stops
every rank, and stacks. On a machine shared with other users it must be a folder only
this user can write, whose name another user cannot take first:

- `disttrain run` (and `disttrain train`, which launches through it) makes one folder
  per job with `tempfile.mkdtemp` (0700, a random name) and hands it to its ranks in
  `GUARD_DIR_ENV` (`for_launch`); each attempt of the job gets a subfolder.
- A rank started another way (plain torchrun, mp.spawn) uses a per-user parent,
  `$TMPDIR/disttrain-guard-u<uid>`, made 0700 and checked; its subfolder is named by
  the attempt (`attempt_name`).

A folder is used only when `check` passes: a real directory (not a symlink), owned by
this user, writable by no one else. Files in it are created with O_EXCL and opened with
O_NOFOLLOW (`create`, `read`), mode 0600, so a planted symlink is never followed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from disttrain.errors import UserError

GUARD_DIR_ENV = "DISTTRAIN_GUARD_DIR"
"""The private folder `disttrain run` made for this job's side channels (one per host)."""
REPORT_NAME = "hang_report.txt"
"""A hang's full report: a launcher keeps a folder that holds one."""
READ_LIMIT = 16 << 20
"""The most bytes `read` returns: heartbeats are small, stack dumps a few MB at most."""


class UnsafeGuardDir(UserError):
    """A side-channel folder that another user could write or swap: not used."""


def check(folder: Path) -> None:
    """Raise `UnsafeGuardDir` unless `folder` is a directory, not a symlink, owned by
    this user and writable by nobody else. Never follows a symlink."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise UnsafeGuardDir(f"the watchdog's folder {folder} cannot be checked: {e.strerror}") from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeGuardDir(f"the watchdog's folder {folder} is a symlink or not a directory; not used.")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeGuardDir(
            f"the watchdog's folder {folder} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}); not used: another user could forge its heartbeats."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeGuardDir(
            f"the watchdog's folder {folder} is writable by its group or by others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); not used: make it 0700."
        )


def make(folder: Path) -> Path:
    """`folder` made 0700 if missing (its parents as `mkdir -p` would), then `check`ed.
    Raises `UnsafeGuardDir` for a folder someone else made or can write, OSError when
    it cannot be made."""
    # exist_ok: ours from a peer rank, or squatted (then `check` refuses it)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check(folder)
    return folder


def attempt_name() -> str:
    """The subfolder name of this attempt of this job on this host: torchrun's run id,
    port and restart count, and a digest of torchrun's per-attempt log folder (the
    agent's own mkdtemp) or of the parent process, so a later job with the same run id
    and port never meets an earlier job's files."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    port = os.environ.get("MASTER_PORT", str(os.getppid()))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    attempt = str(Path(error_file).parent.parent) if error_file else f"ppid {os.getppid()}"
    digest = hashlib.sha256(attempt.encode()).hexdigest()[:12]
    return f"{job}-{port}-r{restart}-{digest}"


def default_dir() -> Path:
    """This attempt's side channel on this host: a subfolder of the launcher's private
    folder (`GUARD_DIR_ENV`), else of the per-user parent. The parent is checked (and
    the per-user one made); raises `UnsafeGuardDir` when it fails the check."""
    given = os.environ.get(GUARD_DIR_ENV)
    if given:
        parent = Path(given)
        check(parent)
    else:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        parent = make(Path(tempfile.gettempdir()) / f"disttrain-guard-u{uid}")
    return parent / attempt_name()


@contextmanager
def for_launch() -> Iterator[Path]:
    """A private folder (mkdtemp: 0700, unpredictable) in `GUARD_DIR_ENV` for the ranks
    this launcher starts, removed afterwards unless an attempt left a hang report in it
    (then the report's path is in the summary the job printed)."""
    folder = Path(tempfile.mkdtemp(prefix="disttrain-guard-"))
    before = os.environ.get(GUARD_DIR_ENV)
    os.environ[GUARD_DIR_ENV] = str(folder)  # always this job's own, never an outer launcher's
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop(GUARD_DIR_ENV, None)
        else:
            os.environ[GUARD_DIR_ENV] = before
        if not any(folder.glob(f"*/{REPORT_NAME}")):
            shutil.rmtree(folder, ignore_errors=True)


def create(path: Path) -> int:
    """A new file at `path` (whatever was there unlinked first, a symlink as itself),
    mode 0600, opened for writing with O_EXCL | O_NOFOLLOW: a descriptor."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o600)


def write(path: Path, data: bytes) -> None:
    """`path` replaced by a new 0600 file holding `data` (see `create`)."""
    fd = create(path)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read(path: Path) -> bytes:
    """The bytes of the regular file `path` (at most `READ_LIMIT`), never through a
    symlink. Raises OSError for a symlink, a missing file or anything not a file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(READ_LIMIT)
    finally:
        os.close(fd)


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot, /proc) when it is this
    user's, else None: with the pid, what names one process across pid reuse."""
    try:
        st = os.stat(f"/proc/{pid}")
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def this_process_start() -> int | None:
    """`process_start` of this process (None where /proc is missing)."""
    return process_start(os.getpid()) if sys.platform.startswith("linux") else None
