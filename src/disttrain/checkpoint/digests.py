"""Checksums computed where the bytes are (P-CKPT-3): each rank hashes the files it
writes while it writes them, and on load each rank verifies its own share.

Save: DCP writes through `hashing_fs.HashingFileSystem`, whose streams feed every byte to
sha256 on its way to the file and fsync the file on close. Only the digests
(`{name: {"size", "sha256"}}`) travel to rank 0, which writes the manifest: no
file is read back before the commit, and the hashing runs on every rank at once
(on the checkpoint thread in async mode, not the training thread).

Load: `share(name, world)` assigns every file of a checkpoint to one rank (its
writer's rank modulo the world size; DCP's `.metadata` and `state.json` to rank
0), so each rank hashes about 1/world of the bytes and every file is hashed by
exactly one rank. The caller agrees on the outcome across ranks.
"""

from __future__ import annotations

import hashlib
import os
import re

_CHUNK = 1 << 23
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.json)$")


def digest_bytes(data: bytes) -> dict:
    """The manifest record of an in-memory file: {"size", "sha256"}."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def sha256_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 8 MiB chunks into one reused buffer
    (hashlib releases the GIL on large buffers, so ranks' threads hash in parallel)."""
    h, size = hashlib.sha256(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def share(name: str, world: int) -> int:
    """The rank that verifies file `name` of a checkpoint on load at `world` ranks:
    the rank that wrote it (`__R_0.distcp`, `rank-0000R.json`) modulo `world`, else 0."""
    m = _OWNER.match(name)
    return int(m.group(1) or m.group(2)) % world if m else 0


class HashingStream:
    """A write stream that feeds every byte it passes on to sha256, in the writing
    thread: the writer's own serialization already keeps this rank's core busy, and
    a second hashing thread measured slower here (GIL hand-offs on DCP's many small
    writes). On close it flushes and fsyncs the file and calls
    `on_close(length, size, sha256)`, `length` being the file's final length (a
    writer that seeked back makes it differ from the bytes hashed).
    """

    def __init__(self, stream, on_close):
        self._stream, self._on_close, self._closed = stream, on_close, False
        self._hash, self._size = hashlib.sha256(), 0

    def write(self, data) -> int:
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self._hash.update(view[:n])  # now: `data` may view memory reused after this call
        self._size += n
        return n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stream.flush()
        os.fsync(self._stream.fileno())  # DCP's own fsync is off: durability is ours
        self._on_close(self._stream.tell(), self._size, self._hash.hexdigest())
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)
