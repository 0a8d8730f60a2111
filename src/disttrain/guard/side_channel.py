"""The watchdog's side channel: one folder per job attempt, shared by its ranks.

Every rank's watchdog writes its heartbeat into the folder, and the last one to stop
removes it. Ranks start and stop in any order, and one rank may stop one watchdog and
start another (a plain script's watchdog hands over to `dt.Job`'s), so a rank can be
starting while another removes the folder over a stale "exited" heartbeat. Two rules
make every interleaving safe:

- `join` makes the folder and writes the rank's first files (its stack file and a
  "running" heartbeat) while holding the folder's lock file shared, and starts over
  when the folder or its lock vanished meanwhile.
- `leave` removes the folder only while holding that lock exclusively, and only when
  `may_remove()` says so then; it takes the lock file away last, and the folder
  itself with `rmdir`, which refuses a folder a starting rank has written to since.

So a removal either ends before a start makes the folder again, or it waits for the
start to finish, and then sees its "running" heartbeat and keeps the folder. The lock
is `flock` on a file in the folder (open for writing, so it also holds on NFS);
where the file system refuses locks, both go ahead unlocked, as before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from disttrain.guard import private_dir

LOCK_NAME = ".lock"
"""The lock file in the side channel (no heartbeat reader globs it)."""
JOIN_TRIES = 100
"""A start retries only after a removal completed, so more than one retry means other
ranks start and stop in a tight loop; past this many the folder cannot be shared."""

T = TypeVar("T")


def join(folder: Path, first_files: Callable[[], T]) -> T:
    """Make `folder` if needed and return `first_files()`, run while no `leave` can
    remove the folder. `first_files` must leave a "running" heartbeat in it, so that a
    later `leave` keeps the folder. Raises OSError when the folder cannot be made (a
    read-only or full disk) or keeps vanishing, `UnsafeGuardDir` when it is not this
    user's private folder."""
    for _ in range(JOIN_TRIES):
        try:
            private_dir.make(folder)  # 0700, ours, not a symlink (UnsafeGuardDir otherwise)
        except FileExistsError:  # removed between mkdir's EEXIST and its is_dir check
            continue
        except private_dir.UnsafeGuardDir:
            if os.path.lexists(folder):
                raise
            continue  # removed by a peer between the mkdir and the check
        fd = _locked(folder, fcntl.LOCK_SH, create=True)
        if fd is None:
            continue  # removed after our mkdir: make it again
        try:
            return first_files()
        finally:
            os.close(fd)
    raise OSError(f"the watchdog's folder {folder} was removed {JOIN_TRIES} times while this rank joined it")


def leave(folder: Path, may_remove: Callable[[], bool]) -> bool:
    """Remove `folder` when `may_remove()`, asked under the exclusive lock, is true.
    True when it was removed. Never raises for a folder that is gone or in use."""
    fd = _locked(folder, fcntl.LOCK_EX, create=False)
    if fd is None:
        return False
    try:
        if not may_remove():
            return False
        for entry in folder.iterdir():
            if entry.name != LOCK_NAME:
                _remove(entry)
        _remove(folder / LOCK_NAME)  # a start waiting on it starts over
    finally:
        os.close(fd)
    try:
        os.rmdir(folder)  # refuses a folder that a start has written to since the unlink
    except OSError:
        return False
    return True


def _locked(folder: Path, mode: int, *, create: bool) -> int | None:
    """An open descriptor of the folder's lock file, locked in `mode`; None when the
    folder (or, for a remover, the lock file) is gone or was removed while we waited."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(folder / LOCK_NAME, flags, 0o600)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        if create:  # a symlink where the lock belongs: never followed; removed, and a start retries
            os.unlink(folder / LOCK_NAME)
        return None
    try:
        fcntl.flock(fd, mode)
    except OSError:
        pass  # a file system without locks: go ahead as before this lock existed
    if os.fstat(fd).st_nlink == 0:  # a remover unlinked it while we waited
        os.close(fd)
        return None
    return fd


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
        return
    try:
        entry.unlink(missing_ok=True)
    except OSError:
        pass  # not ours to remove: the final rmdir then keeps the folder
