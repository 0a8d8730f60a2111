"""The first storage format (`dcp`: DCP's default records and its pickled `.metadata`,
see `storage_formats`) read without running anything its folder holds.

Everything in a checkpoint folder, the manifest and its digests included, is written
by whoever wrote the folder: the digests catch damage, not an author. So:

- `.metadata` is unpickled by `metadata_pickle.MetadataUnpickler`, which resolves only
  the globals DCP's metadata is made of, calls only its classes and sets only their
  declared fields on their instances. Anything else is refused, naming the file and
  what it asked for, before it ran.
- Every data file the metadata names is a file the manifest lists
  (`own_files.check_listed`): nothing outside the folder is read.
- The records: DCP reads tensors with `torch.load(weights_only=True)`; values
  (`BYTE_IO`: optimizer hyper-parameters, ...) its planners read with
  `weights_only=False`, so `SafeReader` reads each with `weights_only=True` first and
  hands the planner that value saved again by torch (`_WeightsOnlyValues`).

Call these only after the manifest verified (`step_folders.verify`).
"""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import cast, overload

import torch
from torch.distributed.checkpoint import FileSystemReader, LoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from disttrain.checkpoint import metadata_bounds, step_folders
from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt, CheckpointUnsafe
from disttrain.checkpoint.digests import file_mismatch
from disttrain.checkpoint.metadata_pickle import MetadataUnpickler
from disttrain.checkpoint.own_files import check_listed, open_own, read_own
from disttrain.runtime import torch_compat

METADATA = ".metadata"


def read_metadata(step_dir: str | Path) -> Metadata:
    """DCP's `Metadata` of `step_dir`, unpickled by `MetadataUnpickler`, each data file
    it names checked to be one its manifest lists. Raises `CheckpointUnsafe` (a
    foreign global, a file outside the manifest, no regular file) or `CheckpointCorrupt`
    (not DCP's metadata, or bytes that fail the manifest's record: they are unpickled
    from the very bytes checked, `own_files.read_own`), each naming the file."""
    path = Path(step_dir) / METADATA
    files = step_folders.read_manifest(Path(step_dir))["files"]
    if METADATA not in files:
        raise CheckpointCorrupt(f"{step_dir}: the manifest lists no {METADATA}.", METADATA)
    try:
        data = read_own(Path(step_dir), METADATA, files[METADATA])
        metadata = MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointCorrupt:
        raise
    except Exception as e:  # what an allowed class raised on a crafted argument, or not a pickle
        raise CheckpointCorrupt(
            f"{path} is not DCP's checkpoint metadata ({type(e).__name__}: {str(e)[:200]}).", METADATA
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorrupt(
            f"{path} is not DCP's checkpoint metadata (it holds a {type(metadata).__name__}).", METADATA
        )
    check_listed(files, [getattr(info, "relative_path", None) for info in metadata.storage_data.values()], by=path)
    metadata_bounds.check(metadata, files, path, exact=False)
    if not isinstance(metadata.storage_meta, StorageMeta):
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeReader(FileSystemReader):
    """DCP's `FileSystemReader` with `read_metadata` and the reads of values made safe
    (module docstring). A load assigns `fs` as with DCP's own reader. `metadata`: the
    `read_metadata` result, when the caller read it already."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self.metadata if self.metadata is not None else read_metadata(Path(self.path))
        if metadata.storage_meta is None:  # (read_metadata sets one; a caller's may lack it)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as DCP's reader does
        return metadata

    def read_data(self, plan, planner):
        # a proxy of DCP's planner: every call passes through but `load_bytes`
        return super().read_data(plan, cast(LoadPlanner, _WeightsOnlyValues(planner, self)))


class _WeightsOnlyValues:
    """`planner` with `load_bytes` reading each value with `weights_only=True`; the
    planner gets the value saved again by `torch.save`, whose unpickling (with
    `weights_only=False`, DCP's) builds only what the weights-only read built."""

    def __init__(self, planner, reader: SafeReader):
        self._planner, self._reader = planner, reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.getvalue()
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            info = self._reader.storage_data.get(read_item.storage_index)
            name = str(getattr(info, "relative_path", ""))
            raise CheckpointUnsafe(
                value_refusal(Path(self._reader.path) / name, read_item.dest_index.fqn, data, e), name
            ) from None
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        self._planner.load_bytes(read_item, again)

    def __getattr__(self, name):
        return getattr(self._planner, name)


@overload
def value_refusal(path: Path, fqn: str, data: bytes, error: Exception) -> str: ...
@overload
def value_refusal(path: Path, fqn: str, data: bytes, error: None = None) -> str | None: ...
def value_refusal(path: Path, fqn: str, data: bytes, error: Exception | None = None) -> str | None:
    """The one line that refuses the value record `data` of `fqn` (in the file `path`),
    naming the globals it asks for beyond the weights-only unpickler's; None when it
    asks for none and `error` (the weights-only read's) is None."""
    try:
        named = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception as e:  # not a torch.save record at all
        named, error = "", error or e
    if not named and error is None:
        return None
    what = f"asks for {named}" if named else f"is no weights-only record ({str(error).splitlines()[0][:120]})"
    return (
        f"{path}: the value {fqn!r} {what}, which a checkpoint's values never hold: refused, "
        f"nothing of it ran. The folder was altered or not written by disttrain; do not load it."
    )


def check_values(step_dir: str | Path, metadata: Metadata) -> None:
    """Raise `CheckpointUnsafe` for the first value record (`BYTE_IO`) of `step_dir`
    whose pickle asks for a global beyond the weights-only unpickler's: what a load
    would refuse, found without unpickling anything (`ckpt verify`). Each file is
    opened by `own_files.open_own` (a regular file of its recorded size)."""
    files = step_folders.read_manifest(Path(step_dir))["files"]
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = Path(step_dir) / info.relative_path
        with open_own(Path(step_dir), info.relative_path, files.get(info.relative_path), limit=None) as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if (refusal := value_refusal(path, index.fqn, data)) is not None:
            raise CheckpointUnsafe(refusal, info.relative_path)


def load_keys(step_dir: str | Path, keys: set[str]) -> dict:
    """The nested state dict of just `keys` (DCP's flattened names), in one process,
    read by `SafeReader`, each file opened by `own_files.open_own` (through
    `VerifyingFileSystem`, hashing none: the caller verified them)."""
    reader = SafeReader(str(step_dir))
    files = step_folders.read_manifest(Path(step_dir))["files"]
    reader.fs = VerifyingFileSystem(Path(step_dir), files, select=lambda name: False)
    return torch_compat.load_keys(keys, storage_reader=reader)


class VerifyingFileSystem(FileSystem):
    """DCP's local `FileSystem` for a load: a file listed in `files` (the manifest's
    {name: record}) that `select(name)` accepts is hashed in one sequential pass
    right when DCP opens it, and only then handed to DCP, whose reads of it then
    come from the page cache: the disk is read once. `verified` holds the names
    checked. (Each rank selects its own share: under DDP every rank reads every
    shard, and a corrupt one fails the load on all ranks through DCP either way.)

    (Reading the whole file into one buffer instead, and handing DCP that buffer,
    measured slower: faulting in fresh memory for a file of 500 MB cost more than
    the second, cached read.) A file that fails raises `CheckpointCorrupt` naming it
    before any of its bytes is deserialised; DCP then fails the load on every rank.
    Every read opens its file once (`own_files.open_own`: no symlink followed, a
    regular file, the size of its record where `files` has one) and DCP reads the
    descriptor that was hashed. Writes pass through unchanged.
    """

    def __init__(self, step_dir: Path, files: dict[str, dict], select=lambda name: True):
        super().__init__()
        self.step_dir, self.files, self.select = Path(step_dir), files, select
        self.verified: set[str] = set()

    @contextmanager
    def create_stream(self, path, mode):
        if "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name
        want = self.files.get(name)
        # opened once (no symlink followed, a regular file of its recorded size), hashed
        # and handed to DCP on that one descriptor: a file swapped after its check is
        # never what DCP reads
        with open_own(self.step_dir, name, want, limit=None) as f:
            if want is not None and name not in self.verified and self.select(name):
                if (bad := file_mismatch(f, want, self.step_dir / name)) is not None:
                    raise CheckpointCorrupt(bad, name)
                self.verified.add(name)
            f.seek(0)
            yield io.BufferedReader(f)
