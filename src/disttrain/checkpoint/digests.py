"""Checksums computed where the bytes are (P-CKPT-3): each rank hashes the files it
writes while it writes them, and a load hashes each file from the very buffer DCP
then deserialises.

The checksums detect corruption (a torn write, a flipped bit, a truncated or
overwritten file), not tampering: the digest is xxHash's xxh3_128, which runs at
several GB/s on one core (sha256 ran at ~1.2 GB/s, slower than the disk). Each
manifest record names its algorithm, `{"size": N, "digest": "xxh3_128:HEX"}`;
records of older versions, `{"size": N, "sha256": HEX}`, still verify.

Save: DCP writes through `hashing_fs.HashingFileSystem`, whose streams feed every
byte to the hash on its way to the file and fsync the file on close. Only the
digests travel to rank 0, which writes the manifest: no file is read back before
the commit, and the hashing runs on every rank at once (on the checkpoint thread
in async mode, not the training thread).

Load: `dcp_read.VerifyingFileSystem` hashes each file DCP opens right then, in
one sequential pass, before DCP reads it (from the page cache by then). `share(name,
world)` assigns every file to one rank (its writer's rank modulo the world size;
`.metadata` and `state.json` to rank 0): a rank also hashes the files of its share
that DCP did not make it read, so every file is checked by at least one rank.
"""

from __future__ import annotations

import hashlib
import os
import re

import xxhash

ALGORITHM = "xxh3_128"
KNOWN = (ALGORITHM, "sha256")
"""The digests a manifest may name: this version's and older manifests'."""
_CHUNK = 1 << 23
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.json)$")


def new_hash(algorithm: str = ALGORITHM):
    """A hash object of `algorithm` ("xxh3_128", or "sha256" for older manifests)."""
    return xxhash.xxh3_128() if algorithm == ALGORITHM else hashlib.new(algorithm)


def record(size: int, hexdigest: str) -> dict:
    """The manifest record of a file hashed with `ALGORITHM`."""
    return {"size": size, "digest": f"{ALGORITHM}:{hexdigest}"}


def expected(want: dict) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest record, of this version or an older one.
    Raises `ValueError` for a record that names no digest."""
    if "digest" in want:
        algorithm, _, hexdigest = str(want["digest"]).partition(":")
        return algorithm, hexdigest
    if "sha256" in want:
        return "sha256", str(want["sha256"])
    raise ValueError(f"a file record without a digest: {want}")


def digest_bytes(data) -> dict:
    """The manifest record of an in-memory file: {"size", "digest"}."""
    return record(len(data), xxhash.xxh3_128_hexdigest(data))


def stream_digest(f, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(bytes read, hex digest) of the open binary file `f` from where it stands to its
    end, read in 8 MiB chunks into one reused buffer (both hashes release the GIL on
    large buffers, so ranks' threads hash in parallel)."""
    h, size = new_hash(algorithm), 0
    # a small file gets a buffer of its size (+1 to see its end in one read): a fresh
    # 8 MiB buffer costs more than hashing a few kilobytes
    buf = bytearray(min(_CHUNK, max(0, os.fstat(f.fileno()).st_size - f.tell()) + 1))
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
        size += n
    return size, h.hexdigest()


def corrupt_message(path, size: int, want: dict) -> str:
    """The one line for a file whose bytes differ from its manifest record."""
    if size != want["size"]:
        return f"{path} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)."
    return f"{path} fails its {expected(want)[0]} checksum (the bytes changed after the save)."


def file_mismatch(f, want: dict, shown) -> str | None:
    """Hash the open binary file `f` (the descriptor the caller then reads, if it
    reads it: `own_files.open_own`) from its start, in one sequential pass, and compare
    the size and digest it read with the manifest record `want` (of this version or
    an older one).

    Returns None when both match, else the one line (`corrupt_message`, naming
    `shown`) with the size as read, so a file cut after an earlier size check is
    reported as truncated. Raises `OSError` when the file cannot be read,
    `ValueError` for a record that names no digest."""
    algorithm, hexdigest = expected(want)
    f.seek(0)
    size, digest = stream_digest(f, algorithm)
    if (size, digest) == (want["size"], hexdigest):
        return None
    return corrupt_message(shown, size, want)


def bytes_mismatch(data, want: dict, shown) -> str | None:
    """`file_mismatch` of a file already read into `data` (a small file, hashed from
    the very bytes that are then parsed)."""
    algorithm, hexdigest = expected(want)
    h = new_hash(algorithm)
    h.update(data)
    if (len(data), h.hexdigest()) == (want["size"], hexdigest):
        return None
    return corrupt_message(shown, len(data), want)


def share(name: str, world: int) -> int:
    """The rank that answers for file `name` of a checkpoint on load at `world` ranks:
    the rank that wrote it (`__R_0.distcp`, `rank-0000R.json`) modulo `world`, else 0."""
    m = _OWNER.match(name)
    return int(m.group(1) or m.group(2)) % world if m else 0


_WRITEBACK = 1 << 25  # a write stream hands the disk every 32 MiB it has written


def _sync_file_range():
    """libc's `sync_file_range` (Linux), or None where it is not there."""
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_START_WRITEBACK = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing `length` bytes at `offset` of `fd` to the disk
    now (SYNC_FILE_RANGE_WRITE: it does not wait), so the disk works while the writer
    serialises and hashes the next records instead of idling until the fsync. Best
    effort: durability is still the fsync's."""
    if _START_WRITEBACK is not None and length > 0:
        _START_WRITEBACK(fd, offset, length, 2)


class HashingStream:
    """A write stream that feeds every byte it passes on to the hash, in the writing
    thread: the writer's own serialization already keeps this rank's core busy, and
    a second hashing thread measured slower here (GIL hand-offs on DCP's many small
    writes). On close it flushes and fsyncs the file and calls
    `on_close(length, size, hexdigest)`, `length` being the file's final length (a
    writer that seeked back makes it differ from the bytes hashed).
    """

    def __init__(self, stream, on_close):
        self._stream, self._on_close, self._closed = stream, on_close, False
        self._hash, self._size, self._handed = new_hash(), 0, 0

    def write(self, data) -> int:
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self._hash.update(view[:n])  # now: `data` may view memory reused after this call
        self._size += n
        if self._size - self._handed >= _WRITEBACK:
            self._stream.flush()
            start_writeback(self._stream.fileno(), self._handed, self._size - self._handed)
            self._handed = self._size
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
