"""DCP's local filesystem with checksums on the way to disk (see `digests`): the
save path of every checkpoint. Imported when a checkpoint is written, so DCP stays
out of start-up.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from disttrain.checkpoint.digests import HashingStream, sha256_file


class HashingFileSystem(FileSystem):
    """DCP's local `FileSystem` that records size + sha256 of every file it
    writes (`digests`, keyed by file name) and fsyncs each one on close.

    `inner` (a `FileSystem`, e.g. the fault-injecting one) opens the streams.
    A stream whose final length differs from the bytes hashed (it seeked) is
    hashed again from the file. Thread-safe: DCP may write with several threads.
    """

    def __init__(self, inner: FileSystem | None = None):
        super().__init__()
        self.inner = inner if inner is not None else FileSystem()
        self.digests: dict[str, dict] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name

        def record(length: int, size: int, digest: str) -> None:
            if length != size:
                size, digest = sha256_file(path)
            with self._lock:
                self.digests[name] = {"size": size, "sha256": digest}

        with self.inner.create_stream(path, mode) as stream:
            hashing = HashingStream(stream, record)
            yield hashing
            hashing.close()  # a no-op when DCP closed it

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes `.metadata.tmp`, then renames it
        with self._lock:
            if (entry := self.digests.pop(Path(path).name, None)) is not None:
                self.digests[Path(new_path).name] = entry
