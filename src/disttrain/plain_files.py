"""Opening a file that someone else may have written (docs/security.md): a checkpoint's,
a run folder's, a script handed to `disttrain doctor`.

Such a file is opened once, and what is read, hashed and parsed comes from that one
descriptor, so nothing swapped in under its name afterwards is read. Before a byte is
read, the open descriptor is checked (`fstat`): it must be a regular file, and no
larger than the bound its caller gives. The open itself never waits (`O_NONBLOCK`: a
FIFO opens at once, and is then refused, instead of hanging until a writer comes) and,
unless the caller follows links on purpose, never follows a symlink (`O_NOFOLLOW`).
"""

from __future__ import annotations

import errno
import io
import os
import stat

from disttrain.errors import UserError

MiB = 1 << 20


class NotPlainFile(UserError):
    """A file refused before any of it was read: a symlink where none is followed, not
    a regular file (a FIFO, a device, a folder, a socket), or larger than its bound.
    `path` is the file; the message names it and what is wrong."""

    def __init__(self, path: str | os.PathLike, why: str):
        super().__init__(f"{path} {why}: refused, it is not read.")
        self.path = str(path)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "no regular file"


def open_plain(path: str | os.PathLike, limit: int | None, *, follow: bool = False) -> io.FileIO:
    """Open `path` for reading as an unbuffered binary file, checked on the open
    descriptor: a regular file of at most `limit` bytes (None: any size). The caller
    closes it. With `follow` a symlink is followed (a user's own script); by default
    it is refused.

    Raises `NotPlainFile` (a `UserError`) for a symlink, a file that is not regular or
    one over `limit`; `OSError` (FileNotFoundError, ...) when it cannot be opened."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise NotPlainFile(path, "is a symlink, which disttrain does not follow here") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPlainFile(path, f"is {_kind(st.st_mode)}, not a regular file")
        if limit is not None and st.st_size > limit:
            raise NotPlainFile(path, f"holds {st.st_size} bytes, more than the {limit} such a file may")
        os.set_blocking(fd, True)  # a regular file: reads wait for the disk as usual
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_at_most(f: io.FileIO, limit: int, path: str | os.PathLike) -> bytes:
    """The rest of the open file `f`, at most `limit` bytes: a file that grew past
    its bound after it was checked raises `NotPlainFile` instead of filling memory."""
    data = bytearray()
    while chunk := f.read(min(limit + 1 - len(data), 8 * MiB)):
        data += chunk
        if len(data) > limit:
            raise NotPlainFile(path, f"grew past the {limit} bytes such a file may while it was read")
    return bytes(data)


def read_plain(path: str | os.PathLike, limit: int, *, follow: bool = False) -> bytes:
    """The bytes of `path`, opened and checked by `open_plain` and read from that one
    descriptor, at most `limit` of them. Raises as `open_plain` does."""
    with open_plain(path, limit, follow=follow) as f:
        return read_at_most(f, limit, path)
