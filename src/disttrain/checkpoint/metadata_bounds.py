"""What a checkpoint's metadata declares, checked against what its folder holds, before
anything is allocated or read by it (docs/security.md).

DCP's metadata, in either storage format, declares each tensor's size and chunks, the
record (file, offset, length) that holds each chunk and value, and the nesting of each
key (`planner_data`). A load, `ckpt inspect` and the exports allocate and read by
these numbers, so a folder could declare a tensor of a terabyte in a file of a
kilobyte, a record past its file's end, or a list index of a billion. `check` refuses
each such declaration in one line naming the file: every record lies inside its file
(the size the manifest records), each chunk's bytes fit its record, the chunks' bytes
together fit the folder, a tensor's size is covered by its chunks, and each key's
nesting is a short path whose list indices stay near the number of keys.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt
from disttrain.checkpoint.metadata_pickle import brief

MAX_PATH = 32
"""The most keys one entry's nesting may have (a state dict nests four or five)."""

INDEX_SLACK = 1024
"""How far past the number of keys a list index in a key's nesting may go (a list's
elements each hold at least one key, but an empty one holds none)."""


def _counts(values, length: int | None = None) -> bool:
    """True when `values` is a sequence of whole numbers >= 0 (of `length` of them)."""
    if not isinstance(values, (tuple, list)):
        return False
    try:
        values = list(values)  # a torch.Size of a number past 64 bits raises only when read
    except (ValueError, OverflowError):
        return False
    if length is not None and len(values) != length:
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _shown(value, limit: int = 60) -> str:
    """`metadata_pickle.brief`: a short text of `value`, at most `limit` characters,
    made in bounded work however deeply it nests or shares its parts; a value that
    cannot be shown (a `torch.Size` of a number past 64 bits raises) is named by its
    type. Never raises."""
    return brief(value, limit)


def _extent(info) -> tuple:
    """(file, offset, length) of a record, from either format's storage data; a file
    named by anything but a string or path is named by `_shown`."""
    name = getattr(info, "file", None) or getattr(info, "relative_path", None)
    name = str(name) if isinstance(name, (str, PurePath)) else _shown(name)
    return name, getattr(info, "offset", None), getattr(info, "length", None)


def _records(md, files: dict) -> tuple[dict, str | None]:
    """{(fqn, chunk offsets or None): (file, offset, length)} of `md.storage_data`, and
    what is wrong with the first record that does not lie inside its file."""
    found: dict = {}
    total = sum(int(want["size"]) for want in files.values())
    declared = 0
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in md.state_dict_metadata:
            return found, f"a record of a key it does not declare ({_shown(index, 80)})"
        name, offset, length = _extent(info)
        if not _counts((offset, length)) or offset + length > int(files.get(name, {}).get("size", 0)):
            return (
                found,
                f"the record of {index.fqn!r} lies outside {name} (offset {_shown(offset)}, length {_shown(length)})",
            )
        declared += length
        found[(index.fqn, None if index.offset is None else tuple(index.offset))] = (name, offset, length)
    if declared > total:
        return found, f"records of {declared} bytes in files of {total} bytes"
    return found, None


def _tensor_problem(fqn: str, meta, records: dict, exact: bool) -> str | None:
    """What is wrong with the tensor entry `meta` of `fqn`, or None."""
    props, size_given = getattr(meta, "properties", None), getattr(meta, "size", None)
    size_given = size_given if isinstance(size_given, (tuple, list)) else None
    size: Any = tuple(size_given) if size_given is not None and _counts(size_given) else None
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        return f"{fqn!r} has no dtype"
    if size is None or not isinstance(meta.chunks, list):
        return f"{fqn!r} has the size {_shown(getattr(meta, 'size', None))}"
    if not _usable(props.dtype):
        return f"{fqn!r} has the dtype {props.dtype}, which holds no plain data"
    covered = 0
    for chunk in meta.chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (
            _counts(chunk.offsets, len(size)) and _counts(chunk.sizes, len(size))
        ):
            return f"{fqn!r} has a chunk of another rank than its size {tuple(size)}"
        if any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, size, strict=False)):
            return f"{fqn!r} has a chunk outside its size {tuple(size)}"
        record = records.get((fqn, tuple(chunk.offsets)))
        nbytes = math.prod(chunk.sizes) * props.dtype.itemsize
        if record is None or (record[2] != nbytes if exact else record[2] < nbytes):
            return f"the chunk of {fqn!r} at {tuple(chunk.offsets)} has no record of its {nbytes} bytes"
        covered += math.prod(chunk.sizes)
    if math.prod(size) > covered:
        return f"{fqn!r} declares {math.prod(size)} elements, its chunks hold {covered}"
    return None


@functools.cache
def _usable(dtype: torch.dtype) -> bool:
    """True when a tensor of `dtype` can be made (not a quantized dtype, say)."""
    try:
        torch.empty(0, dtype=dtype)
        return True
    except (RuntimeError, TypeError):
        return False


def _path_problem(md) -> str | None:
    """What is wrong with `md.planner_data` (each key's nesting), or None."""
    paths = md.planner_data or {}
    if not isinstance(paths, dict):
        return "a nesting that is no table"
    limit = len(md.state_dict_metadata) + INDEX_SLACK
    kinds: dict[tuple, type] = {}  # each prefix -> the type of the key that follows it
    leaves = set()
    for fqn, path in paths.items():
        if not isinstance(path, (tuple, list)) or not 0 < len(path) <= MAX_PATH:
            return f"the nesting of {_shown(fqn, 80)!r} is {_shown(path, 60)}"
        for depth, key in enumerate(path):
            whole = isinstance(key, int) and not isinstance(key, bool)
            if not (isinstance(key, str) or whole and 0 <= key < limit):
                return f"the nesting of {_shown(fqn, 80)!r} holds the key {_shown(key, 40)!r}"
            prefix = tuple(path[:depth])
            if kinds.setdefault(prefix, type(key)) is not type(key) or prefix in leaves:
                return f"the nesting of {_shown(fqn, 80)!r} clashes with another key's"
        leaves.add(tuple(path))
    if any(leaf in kinds for leaf in leaves):
        return "a key nested inside another key's value"
    return None


def check(md, files: dict, path: Path, *, exact: bool) -> None:
    """Raise `CheckpointCorrupt` naming `path` (the `.metadata`) unless everything DCP's
    metadata `md` declares fits its folder (the module docstring); `files` is the
    manifest's records. `exact`: a chunk's record holds exactly its raw bytes (the
    `raw-1` format), else at least them (a `torch.save` record)."""
    state = md.state_dict_metadata
    if not isinstance(state, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointCorrupt(f"{path} is not DCP's checkpoint metadata (no table of keys).", path.name)
    records, why = _records(md, files)
    for fqn, meta in state.items() if why is None else ():
        if not isinstance(fqn, str):
            why = f"the key {_shown(fqn, 60)!r}, which is not a string"
        elif isinstance(meta, TensorStorageMetadata):
            why = _tensor_problem(fqn, meta, records, exact)
        elif not isinstance(meta, BytesStorageMetadata):
            why = f"{fqn!r} is neither a tensor nor a value"
        elif (fqn, None) not in records:
            why = f"the value {fqn!r} has no record"
        if why is not None:
            break
    why = why or _path_problem(md)
    if why is not None:
        raise CheckpointCorrupt(f"{path} declares {why}: the checkpoint is damaged or was altered.", path.name)
