"""Paths a command writes: checked before anything is written, so that nothing a user
types overwrites what they had, and an unwritable place is one line, not a traceback.

Two checks, used by every command that writes:

- `output_file(path, what)` for one file a command creates (`ckpt export --to`,
  `plan --png`, `report --out`, `launch-file -o`). An existing path is refused unless
  `replaceable(path)` says it is an earlier output of the same kind (a PNG the report
  wrote, say); a directory, a device or any other non-regular file is always refused.
- `writable_dir(path, what)` for a directory a job writes into (`train.out_dir`,
  `checkpoint.dir`): it must be a directory, or creatable, on a writable filesystem.

Writability is probed by creating and removing one temporary file in the directory
(or in its nearest existing ancestor when it does not exist yet): permission bits
say nothing for root, and only a real write sees a read-only mount. Nothing is left
behind, and a directory that does not exist is not created here.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from disttrain.errors import UserError


def _probe(directory: Path) -> str | None:
    """None when a file can be created in `directory`, else why not (one phrase)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".disttrain-probe-", dir=directory)
    except OSError as e:
        if e.errno == errno.EROFS:
            return "it is on a read-only filesystem"
        if e.errno in (errno.EACCES, errno.EPERM):
            return "permission denied"
        if e.errno == errno.ENOSPC:
            return "the disk is full"
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(name)
    return None


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (as anything: a file stops the walk)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _check_creatable(path: Path, what: str, fix: str) -> None:
    """Raise `UserError` unless the directories up to `path` exist or can be made."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise UserError(f"{what} {path}: {base} is a file, not a directory, so nothing can be created under it. {fix}")
    why = _probe(base)
    if why is not None:
        raise UserError(f"{what} {path} cannot be written: {base}: {why}. {fix}")


def writable_dir(path: str | os.PathLike, what: str, *, fix: str = "") -> Path:
    """`path` as a directory that a job can write into: an existing, writable directory,
    or a path whose nearest existing ancestor is a writable directory. `what` names
    the setting in the message (e.g. "train.out_dir"). Raises `UserError`."""
    fix = fix or f"Point {what} at a writable directory."
    text = os.fspath(path)
    if not text.strip():
        raise UserError(f"{what} is empty; it would write into the current directory. {fix}")
    p = Path(text).expanduser()
    if os.path.lexists(p) and not p.is_dir():
        raise UserError(f"{what} {p} is a file, not a directory. {fix}")
    _check_creatable(p, what, fix)
    return p


def describe_kind(path: Path) -> str:
    """'a directory', 'a device', 'a link', ...: what a non-regular path is."""
    mode = os.lstat(path).st_mode
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def output_file(path: str | os.PathLike, what: str, replaceable: Callable[[Path], bool] | None = None) -> Path:
    """`path` as a new file that a command may create: refused (`UserError`) when it
    exists as anything but a regular file that `replaceable` accepts, or when its
    directory cannot be written. `what` names the option (e.g. "--to")."""
    text = os.fspath(path)
    if not text.strip():
        raise UserError(f"{what} is empty; name the file to write.")
    p = Path(text).expanduser()
    if os.path.lexists(p):
        if p.is_symlink() or not p.is_file():
            raise UserError(f"{what} {p} is {describe_kind(p)}; name a new file to write.")
        if replaceable is None or not replaceable(p):
            raise UserError(
                f"{what} {p} already exists and would be overwritten; choose a new "
                f"file name, or move that file away first."
            )
    _check_creatable(p.parent, what, f"Choose {what} in a writable directory.")
    return p


def has_prefix(prefix: bytes) -> Callable[[Path], bool]:
    """A `replaceable` test: the file starts with `prefix` (e.g. the PNG signature), so it
    is an earlier output of the same kind and may be replaced."""

    def check(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(prefix)) == prefix
        except OSError:
            return False

    return check


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
