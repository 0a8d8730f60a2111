"""The storage format `raw-1`: DCP's planner (so resharding across world sizes and
strategies is DCP's own), with storage of ours that writes and reads in large
sequential records and never pickles.

A rank's data file `__R_0.distcp` is its non-tensor values (JSON, `json_records`)
followed by its tensors' raw bytes, each record where `.metadata` (JSON) says. A save
writes each tensor straight from its memory, hashing the bytes on their way to the file
(`digests.HashingStream`), and fsyncs once per file. A load reads each record with one
`readinto` straight into the tensor it restores when the record is the whole target
(every DDP load, an FSDP load at the same world size), else into one buffer that is
then narrowed; a file of this rank's share (`digests.share`) is hashed in the same
sequential pass, gaps included, and checked against the manifest before its JSON
values are parsed; the other ranks' files are read at the same time on a reader
thread (`raw_read`). Nothing of a checkpoint in this format is ever unpickled.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from concurrent.futures import Future as ThreadFuture
from pathlib import Path

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from disttrain.checkpoint import metadata_bounds, step_folders
from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt
from disttrain.checkpoint.digests import HashingStream, corrupt_message, digest_bytes, expected, new_hash, record
from disttrain.checkpoint.files import fsync_file
from disttrain.checkpoint.finite_tensors import FiniteTally
from disttrain.checkpoint.json_records import Extent, metadata_bytes, metadata_of, set_path, value_bytes, value_of
from disttrain.checkpoint.own_files import check_listed, open_own, read_own
from disttrain.checkpoint.raw_read import FileRead, narrow, pool, read_all, read_exact, shared_storages, stop_for

FORMAT = "raw-1"
METADATA = ".metadata"


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor `t`, writable, sharing its memory; the
    view keeps `t` alive. (A ctypes array at the tensor's address: the way through
    `reshape`, `view` and `numpy` cost four dispatcher calls, about 8 us, per record.)"""
    if not t.numel():
        return memoryview(bytearray())
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    # the memory is the tensor's: hold it as long as the view (a ctypes instance takes
    # attributes; the stubs declare none)
    raw.owner = t  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


class JsonSavePlanner(DefaultSavePlanner):
    """DCP's default save planner whose non-tensor values are JSON, not `torch.save`.
    Its plans are cached (DCP's `enable_plan_caching`): a save of the same layout as
    the previous one sends no plans between the ranks. The cache is per `cache_key`,
    which every rank must give alike and which names one process group's saves (a
    Checkpointer's run id): DCP keeps it per process, so after an in-memory recovery a
    newcomer without a cache would wait for a plan the survivors think it has."""

    def __init__(self, cache_key: str):
        from disttrain.runtime.torch_compat import set_plan_cache_key

        super().__init__(enable_plan_caching=True)
        set_plan_cache_key(self, f"{type(self).__name__}-{cache_key}")

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(value_bytes(object))
        return object


class JsonLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor values are parsed from JSON."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value_of(value.getvalue()))


# ---------------------------------------------------------------- save


class RawWriter(StorageWriter):
    """Writes one data file per rank and, on the coordinator, `.metadata` as JSON.
    `digests` records {file name: manifest record} of every file this rank wrote, each
    fsynced on close. `inner` (a DCP `FileSystem`, e.g. the fault-injecting one) opens
    the data files' streams. `finite` tallies each tensor written under the key prefix
    `finite_prefix` (the model's weights) just before it is written: the tensors this
    rank saves, from the very memory written (an async save's staged copy). With
    `syncer` (an executor), `.metadata` is fsynced there: wait for `pending` before
    the commit."""

    def __init__(
        self,
        path: str | Path,
        inner: FileSystem | None = None,
        finite_prefix: str = "model.",
        syncer: Executor | None = None,
    ):
        super().__init__()
        self.path, self.inner = Path(path), inner if inner is not None else FileSystem()
        self.digests: dict[str, dict] = {}
        self.pending: list[ThreadFuture] = []  # `.metadata`'s fsync on `syncer`, when one is given
        self._syncer = syncer
        self.finite, self._finite_prefix = FiniteTally(), finite_prefix
        self._lock = threading.Lock()

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def _stream(self, name: str, opener):
        def on_close(length: int, size: int, digest: str) -> None:
            with self._lock:
                self.digests[name] = record(size, digest)

        return HashingStream(opener, on_close)

    def write_data(self, plan, planner) -> Future:
        results = []
        if plan.items:
            name = f"{plan.storage_data}0.distcp"
            with self.inner.create_stream(self.path / name, "wb") as raw:
                stream = self._stream(name, raw)
                objects = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
                for item in objects + [i for i in plan.items if i.type != WriteItemType.BYTE_IO]:
                    results.append(self._write_item(stream, name, item, planner))
                stream.close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_item(self, stream: HashingStream, name: str, item, planner) -> WriteResult:
        offset = stream.tell()
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            length = stream.write(data.getbuffer())
        else:
            t = data.detach()
            if item.index.fqn.startswith(self._finite_prefix):
                self.finite.add(t)
            t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
            length = stream.write(byte_view(t)) if t.numel() else 0
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=Extent(name, offset, length))

    def finish(self, metadata, results) -> None:
        storage = {r.index: r.storage_data for part in results for r in part}
        data = metadata_bytes(dataclasses.replace(metadata, storage_data=storage))
        with open(self.path / METADATA, "wb") as f:
            f.write(data)
        self.digests[METADATA] = digest_bytes(data)
        if self._syncer is None:
            fsync_file(self.path / METADATA)
        else:  # the caller waits for it before its commit, while it writes the manifest
            self.pending.append(self._syncer.submit(fsync_file, self.path / METADATA))

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)


# ---------------------------------------------------------------- load


def read_metadata(step_dir: str | Path):
    """DCP's `Metadata` of a raw-format checkpoint, parsed from JSON: from the very
    bytes checked against the manifest's record (`own_files.read_own`). Raises
    `CheckpointCorrupt` for a `.metadata` that is missing from the manifest, fails its
    check or is not this format's JSON, or `CheckpointUnsafe` when it is no regular
    file or names a data file its manifest does not list."""
    path = Path(step_dir) / METADATA
    files = step_folders.read_manifest(Path(step_dir))["files"]
    if METADATA not in files:
        raise CheckpointCorrupt(f"{step_dir}: the manifest lists no {METADATA}.", METADATA)
    try:
        metadata = metadata_of(read_own(Path(step_dir), METADATA, files[METADATA]))
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise CheckpointCorrupt(f"{path} is not a {FORMAT} metadata document ({e}).", METADATA) from None
    check_listed(files, {extent.file for extent in metadata.storage_data.values()}, by=path)
    metadata_bounds.check(metadata, files, path, exact=True)
    return metadata


class RawReader(StorageReader):
    """Reads a raw-format checkpoint for DCP's load. A file listed in `files` (the
    manifest's records) that `select(name)` accepts is hashed while it is read and
    checked before its JSON values are parsed; `verified` holds the names checked.
    A mismatch raises `CheckpointCorrupt` naming the file. `metadata`: the parsed
    `.metadata`, when the caller read it already."""

    def __init__(
        self,
        path: str | Path,
        files: dict[str, dict] | None = None,
        select: Callable[[str], bool] = lambda name: True,
        metadata=None,
    ):
        super().__init__()
        self.path, self.files, self.select = Path(path), files or {}, select
        self.verified: set[str] = set()
        self.metadata = metadata  # parsed once: a load's compatibility check read it already

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs):
        if self.metadata is None:
            self.metadata = read_metadata(self.path)
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        storage = self.metadata.storage_data
        per_file: dict[str, dict[Extent, list]] = {}
        for item in plan.items:
            extent = storage[item.storage_index]
            per_file.setdefault(extent.file, {}).setdefault(extent, []).append(item)
        # This rank's share on this thread, each other file on a reader thread at once
        # (`raw_read`): on one machine each rank reads its share from the disk, and
        # finds the others' in the page cache as their ranks read them.
        names = sorted(per_file, key=lambda n: (not self.select(n), n))
        stop_for(self.path)  # the page-cache prefetch of a load (`raw_read.prefetch_share`) is done
        shared = shared_storages(per_file, planner.resolve_tensor) if len(names) > 1 else set()
        done = read_all(names, self.select, lambda n, cached: self._read_file(n, per_file[n], planner, shared, cached))
        for _objects, later in done:  # in the order one thread would have read them
            for buf, items in later:
                self._copy_out(buf, items, planner)
        for objects, _ in done:  # each file's values, parsed only once it verified
            for item, data in objects:
                planner.load_bytes(item, io.BytesIO(bytes(data)))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str, records: dict[Extent, list], planner, shared: set[int], cached=None) -> tuple:
        """Read one file; returns (its values to parse, its records for memory that
        another file's records target too, as (buffer, items) to copy out later)."""
        path = self.path / name
        want = self.files.get(name)
        if want is not None and (name in self.verified or not self.select(name)):
            want = None  # nothing to check: verified already, or not selected
        objects, later = [], []
        with open_own(self.path, name, self.files.get(name), limit=None) as f:
            # the process's hash thread; `read.close` waits for this file's hashes
            read = FileRead(f, path, new_hash(expected(want)[0]) if want is not None else None, pool("hash"), cached)
            try:
                for extent in sorted(records, key=lambda e: e.offset):
                    read.skip_to(extent.offset)
                    items = records[extent]
                    if items[0].type == LoadItemType.BYTE_IO:
                        data = bytearray(extent.length)
                        read.into(memoryview(data))
                        objects += [(item, data) for item in items]
                    elif (buf := self._read_tensor(read, extent, items, planner, shared)) is not None:
                        later.append((buf, items))
                if want is not None:
                    size, digest = read.digest()
                    if (size, digest) != (want["size"], expected(want)[1]):
                        raise CheckpointCorrupt(corrupt_message(path, size, want), name)
                    self.verified.add(name)
            finally:
                read.close()
        return objects, later

    def _read_tensor(self, read: FileRead, extent: Extent, items: list, planner, shared: set[int]):
        """Read one tensor record into its target, or into a buffer that is returned
        when its target's memory is in `shared` (copied out once every file is read)."""
        index = items[0].storage_index
        meta = self.metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
        dtype, sizes = meta.properties.dtype, tuple(chunk.sizes)
        if len(items) == 1 and all(o == 0 for o in items[0].storage_offsets) and tuple(items[0].lengths) == sizes:
            target = planner.resolve_tensor(items[0]).detach()
            ptr = target.untyped_storage().data_ptr()
            if (
                target.device.type == "cpu"
                and target.dtype == dtype
                and target.is_contiguous()
                and target.numel() * dtype.itemsize == extent.length
                and ptr not in shared
            ):
                if extent.length:
                    read.into(byte_view(target), ptr)
                planner.commit_tensor(items[0], target)  # a no-op in both planners: safe on a thread
                return None
        buf = torch.empty(sizes, dtype=dtype)
        if extent.length:
            read.into(byte_view(buf))
        if any(planner.resolve_tensor(item).untyped_storage().data_ptr() in shared for item in items):
            return buf
        self._copy_out(buf, items, planner)
        return None

    @staticmethod
    def _copy_out(buf: torch.Tensor, items: list, planner) -> None:
        for item in items:
            target = planner.resolve_tensor(item).detach()
            target.copy_(narrow(buf, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)


def load_keys(step_dir: str | Path, keys: set[str]) -> dict:
    """The nested state dict of just `keys` (flattened names, or prefixes of them at a
    dot: "optim.param_groups"), each tensor assembled whole from its chunks, in one
    process without DCP's loader (the export's reader). Call only after the manifest
    verified."""
    step_dir = Path(step_dir)
    md = read_metadata(step_dir)
    files = step_folders.read_manifest(step_dir)["files"]
    out: dict = {}
    wanted = [k for k in md.state_dict_metadata if k in keys or any(k.startswith(p + ".") for p in keys)]
    for key in sorted(wanted):
        meta = md.state_dict_metadata[key]
        extents = [(i, e) for i, e in md.storage_data.items() if i.fqn == key]
        if not isinstance(meta, TensorStorageMetadata):
            value = value_of(_read_extent(step_dir, files, extents[0][1], bytearray(extents[0][1].length)))
        else:
            value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            for index, extent in extents:
                chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
                part = torch.empty(tuple(chunk.sizes), dtype=meta.properties.dtype)
                _read_extent(step_dir, files, extent, byte_view(part) if extent.length else memoryview(b""))
                narrow(value, chunk.offsets, chunk.sizes).copy_(part)
        set_path(out, md.planner_data.get(key, (key,)), value)
    return out


def _read_extent(step_dir: Path, files: dict, extent: Extent, into):
    """Read the record `extent` into the writable buffer `into`; returns `into`. The
    file is opened by `own_files.open_own` (a regular file of its recorded size in
    `files`, the manifest's records, no symlink followed)."""
    with open_own(step_dir, extent.file, files.get(extent.file), limit=None) as f:
        f.seek(extent.offset)
        read_exact(f, memoryview(into), step_dir / extent.file)
    return into
