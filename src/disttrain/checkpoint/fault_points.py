"""Checkpoint fault points, driven by the library's `disttrain.runtime.fault_injection` spec
(`DISTTRAIN_FAULT="ACTION@PHASE:rank=R,step=S"`), so users can crash-test their
own jobs the way disttrain's tests do:

    kill@checkpoint.shards         SIGKILL in the middle of writing a shard file
    enospc@checkpoint.shards       a full disk (ENOSPC) while writing a shard
    kill@checkpoint.after_shards   every shard written, the manifest not yet
    kill@checkpoint.during_commit  the manifest written, the commit rename not yet

`step` is the checkpoint's step. Without the variable each hook costs one check.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.filesystem import FileSystem

from disttrain.runtime import fault_injection as faults


def fault_point(point: str, rank: int, step: int) -> None:
    """Fire any fault armed for `checkpoint.POINT` at (rank, step)."""
    faults.inject(f"checkpoint.{point}", step, rank)


class _FaultyStream:
    """A shard stream that fires `checkpoint.shards` once half of its first write
    is on disk, so a kill leaves a real half-written file."""

    def __init__(self, stream, rank: int, step: int):
        self._stream, self._rank, self._step, self._fired = stream, rank, step, False

    def write(self, data) -> int:
        if not self._fired and len(data) > 1:
            self._fired = True
            half = self._stream.write(bytes(memoryview(data)[: len(data) // 2]))
            self._stream.flush()
            os.fsync(self._stream.fileno())
            fault_point("shards", self._rank, self._step)
            return half + self._stream.write(bytes(memoryview(data)[len(data) // 2 :]))
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Wrapped:
    def __init__(self, cm, rank: int, step: int):
        self._cm, self._rank, self._step = cm, rank, step

    def __enter__(self):
        return _FaultyStream(self._cm.__enter__(), self._rank, self._step)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


class FaultyFileSystem(FileSystem):
    """DCP's local `FileSystem` whose shard (.distcp) streams carry the hook."""

    def __init__(self, rank: int, step: int):
        super().__init__()
        self._rank, self._step = rank, step

    def create_stream(self, path, mode):
        cm = super().create_stream(path, mode)
        if "w" in mode and str(path).endswith(".distcp"):
            return _Wrapped(cm, self._rank, self._step)
        return cm


def shard_filesystem(rank: int, step: int) -> FileSystem | None:
    """A `FaultyFileSystem` when a `checkpoint.shards` fault is armed, else None."""
    if any(f.phase == "checkpoint.shards" for f in faults.active()):
        return FaultyFileSystem(rank, step)
    return None
