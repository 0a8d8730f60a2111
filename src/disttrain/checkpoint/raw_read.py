"""How a `raw-1` load reads its data files: this rank's share on the calling thread,
hashed as it is read, and every other file at the same time on a reader thread of its own.

Under DDP every rank reads every file, and each file is read cold by the rank of its
share (`digests.share`) at the same moment. Each reader thread follows its file's rank
through it, so it finds the bytes in the page cache (or waits on pages the
kernel is already reading for them): the disk serves each byte once, and the copies
out of the page cache run while this rank waits on the disk for its own share. Read
one after the other, those copies came after the disk's last byte.

The threads write into the state's tensors at once, so no memory may be written
by two: a storage targeted by records of more than one file (a tied weight, whose
two names DCP may store in two ranks' files) is read into a buffer of its own and
copied into the tensor after every thread finished, in the order a one-thread read
would have written it. Non-tensor values are parsed on the calling thread, after
their file verified. Records of one file are read in offset order by one thread;
`FileRead` keeps a hash from reading over bytes still being hashed.

`prefetch_share` starts reading this rank's share from the disk into the page cache
once a load has read and checked its small files (`.metadata`, `state.json`, its RNG
file: read cold behind the prefetch's stream they cost more than the stream saved),
while the load does its fixed work (the compatibility check, an all-gather, the plan);
it stops when the reads into the tensors begin, which then find those bytes cached. It
only warms the cache: every byte the load uses is still read, and hashed, by
`FileRead`. The reader, hash and prefetch threads are kept per process (`pool`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt
from disttrain.plain_files import NotPlainFile, open_plain

_SCRATCH = 1 << 23
_PIECE = 1 << 24  # a record is read and hashed in pieces of 16 MiB
_READERS = 7  # reader threads for the other ranks' files: one per file on a node of 8
_BATCH = 1 << 22  # smaller records go to the hash thread together, 4 MiB at a time


def _hash_all(hasher, views: list[memoryview]) -> None:
    for view in views:
        hasher.update(view)


_POOLS: dict[tuple[int, str], ThreadPoolExecutor] = {}


def pool(name: str) -> ThreadPoolExecutor:
    """This process's one-thread pool `name` ("read", "hash", "prefetch"), made on
    first use and kept: a thread started per load cost milliseconds of a small load
    (each start waits for the new thread to be scheduled). Keyed by the process id,
    since a forked child has none of its parent's threads."""
    key = (os.getpid(), name)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"disttrain-{name}")
    return _POOLS[key]


def read_exact(f, view: memoryview, path: Path) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointCorrupt(f"{path} ends before its records do (truncated).", path.name)
        got += n


def read_cached(f, view: memoryview, path: Path, done: threading.Event) -> None:
    """`read_exact`, but only from the page cache (RWF_NOWAIT) until `done` is set:
    while the bytes are not there yet (their rank is still reading them from the
    disk) wait a moment, so that this reader never races that rank to the disk.
    Where the kernel cannot read without waiting, a plain read."""
    pos, got, nowait = f.tell(), 0, getattr(os, "RWF_NOWAIT", None)
    while got < len(view) and nowait is not None and not done.is_set():
        try:
            n = os.preadv(f.fileno(), [view[got:]], pos + got, nowait)
        except BlockingIOError:
            done.wait(0.002)
            continue
        except OSError:
            break  # RWF_NOWAIT is not supported here
        if not n:
            break  # the end of the file: `read_exact` reports the truncation
        got += n
    f.seek(pos + got)
    read_exact(f, view[got:], path)


def narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=False)):
        t = t.narrow(dim, start, length)
    return t


class FileRead:
    """One sequential pass over one data file: records in offset order, each read
    once; with `hasher`, every byte (gaps too) is hashed on the way. Records are read
    in pieces and hashed on `pool`'s one thread while the next piece is read (xxh3
    releases the GIL), so the hash costs no time while the disk is the bottleneck.
    Small records are handed to that thread in batches (`_BATCH`): a hand-off per
    bias or norm weight cost more than hashing it."""

    def __init__(self, f, path: Path, hasher, pool: ThreadPoolExecutor, cached: threading.Event | None = None):
        self.f, self.path, self.hasher, self.pos, self._pool = f, path, hasher, 0, pool
        self._cached = cached  # read only from the page cache until it is set (`read_cached`)
        self._pending: list = []
        self._batch: list[memoryview] = []  # read, not yet handed to the hash thread
        self._batched = 0
        self._filled: set[int] = set()  # storages with bytes still to be hashed
        self._scratch: bytearray | None = None  # for gaps and the tail: most files have neither

    def _buffer(self) -> memoryview:
        if self._scratch is None:
            left = os.fstat(self.f.fileno()).st_size - self.pos
            self._scratch = bytearray(max(1, min(_SCRATCH, left + 1)))
        return memoryview(self._scratch)

    def _submit(self) -> None:
        if self._batch:
            self._pending.append(self._pool.submit(_hash_all, self.hasher, self._batch))
            self._batch, self._batched = [], 0

    def _drain(self) -> None:
        self._submit()
        for fut in self._pending:
            fut.result()
        self._pending, self._filled = [], set()

    def skip_to(self, offset: int) -> None:
        if self.hasher is None:
            self.f.seek(offset)
            self.pos = offset
            return
        if self.pos < offset:
            self._drain()  # the gap goes through the one scratch buffer: the hash is in order
        while self.pos < offset:
            view = self._buffer()[: offset - self.pos]
            read_exact(self.f, view, self.path)
            self.hasher.update(view)
            self.pos += len(view)

    def into(self, view: memoryview, storage: int | None = None) -> None:
        """Read the next `len(view)` bytes into `view`. `storage`: the address of the
        tensor storage `view` lies in, if it may be read into again in this pass."""
        if storage in self._filled:
            self._drain()  # a tied weight read twice: its first bytes are yet to be hashed
        if storage is not None:
            self._filled.add(storage)
        for start in range(0, len(view), _PIECE):
            piece = view[start : start + _PIECE]
            if self._cached is None:
                read_exact(self.f, piece, self.path)
            else:
                read_cached(self.f, piece, self.path, self._cached)
            if self.hasher is not None:
                self._batch.append(piece)
                self._batched += len(piece)
                if self._batched >= _BATCH:
                    self._submit()
        self.pos += len(view)

    def digest(self) -> tuple[int, str]:
        """(bytes hashed, hex digest) once the rest of the file is hashed too."""
        self._drain()
        while n := self.f.readinto(scratch := self._buffer()):
            self.hasher.update(scratch[:n])
            self.pos += n
        return self.pos, self.hasher.hexdigest()

    def close(self) -> None:
        """Wait for the hashes still running: none reads a buffer after this."""
        self._drain()


def shared_storages(per_file: dict[str, dict], resolve) -> set[int]:
    """The storages (addresses) that tensor records of more than one file target;
    `resolve(item)` gives a tensor item's target."""
    files_of: dict[int, set[str]] = {}
    for name, records in per_file.items():
        for items in records.values():
            for item in items:
                if item.type.name != "BYTE_IO":
                    files_of.setdefault(resolve(item).untyped_storage().data_ptr(), set()).add(name)
    return {ptr for ptr, names in files_of.items() if len(names) > 1}


def read_all(names: list[str], own, read_file) -> list:
    """Run `read_file(name, cached)` for every file in `names`: those `own(name)`
    accepts on this thread, in order (`cached` None), the rest meanwhile on reader
    threads, one per file up to `_READERS` (dealt out in turn beyond), starting with
    the file after the last of this rank's share, from the page cache only until this
    thread's reads are done (`cached`, an event; `read_cached`). Each reader follows
    its file's rank as that rank reads it cold: one reader for all of them kept pace
    with one rank, and at 4 ranks copied the two files it reached last after the
    disk's last byte (0.16 s of a 1 GB load, on one machine's timers). Returns the
    results in the order of `names`; waits for every thread before it raises the
    first failure (this rank's share first)."""
    mine = [n for n in names if own(n)]
    rest = [n for n in names if not own(n)]
    if mine and rest:
        after = [n for n in rest if n > mine[-1]]
        rest = after + [n for n in rest if n <= mine[-1]]
    results: dict[str, object] = {}
    done = threading.Event()
    k = min(len(rest), _READERS)
    others = [
        pool(f"read-{i}").submit(lambda part: [(n, read_file(n, done)) for n in part], rest[i::k]) for i in range(k)
    ]
    try:
        for name in mine:
            results[name] = read_file(name, None)
    finally:
        done.set()
        theirs = [e for e in (fut.exception() for fut in others) if e is not None]  # waits for them
    if theirs:
        raise theirs[0]
    for fut in others:
        results.update(fut.result())
    return [results[n] for n in names]


_PREFETCH: dict[Path, threading.Event] = {}  # step directory -> its prefetch's stop


def prefetch_share(step_dir: Path, rank: int, world: int) -> None:
    """Start reading the data files of this rank's share of `step_dir` into the page
    cache on a thread, until they end or `stop_for(step_dir)`. Best effort: a file
    that cannot be read is left to the load to report."""
    from disttrain.checkpoint.digests import share

    step_dir = Path(step_dir)
    try:
        files = sorted(p for p in step_dir.iterdir() if p.suffix == ".distcp" and share(p.name, world) == rank)
    except OSError:
        return
    stop = _PREFETCH[step_dir] = threading.Event()
    pool("prefetch").submit(_warm, step_dir, files, stop)


def _warm(step_dir: Path, files: list[Path], stop: threading.Event) -> None:
    buf = bytearray(_SCRATCH)
    try:
        for path in files:
            # never a FIFO (its open would wait for a writer, and this thread with it),
            # a device or a symlink: only what a load itself would read
            with open_plain(path, None) as f:
                while not stop.is_set() and f.readinto(buf):
                    pass
    except (OSError, NotPlainFile):
        pass
    finally:
        if _PREFETCH.get(step_dir) is stop:
            del _PREFETCH[step_dir]


def stop_for(step_dir: Path) -> None:
    """Stop the prefetch of `step_dir`, if one runs (its thread ends within a read)."""
    if (stop := _PREFETCH.get(Path(step_dir))) is not None:
        stop.set()
