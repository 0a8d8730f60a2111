"""JSON forms of what DCP would pickle (the storage format `raw-1`, see `raw_storage`):
the non-tensor values of a state dict (an optimizer's `param_groups`) and DCP's
`Metadata`, so a load parses JSON and never unpickles.

Values: JSON's own types stand for themselves (floats exactly, NaN and infinities
as JSON's extension tokens); a tuple is `{"__tuple__": [...]}`, a dict with a key that
is not a string (or a key that looks like a tag) is `{"__dict__": [[k, v], ...]}`, a
`torch.dtype` is `{"__dtype__": "float32"}`. Anything else is refused at save time
with a `TypeError` that names its type: no value is ever stored as a pickle.

Metadata: `{"version", "tensors": {fqn: {"dtype", "size", "chunks": [{"offsets",
"sizes", "file", "offset", "length"}]}}, "objects": {fqn: {"file", "offset",
"length"}}, "paths": {fqn: [key, ...]}}`: DCP's `state_dict_metadata`, `storage_data`
and `planner_data` (the nesting of each flattened key), rebuilt as DCP's own classes
on load, so DCP's planner reshards exactly as with its own format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from disttrain import json_text

_TAGS = ("__tuple__", "__dict__", "__dtype__")


@dataclass(frozen=True)
class Extent:
    """Where one record lies: `length` bytes at `offset` of the data file `file`
    (DCP's per-item `storage_data` of the raw format)."""

    file: str
    offset: int
    length: int


# ---------------------------------------------------------------- values


def encode_value(obj: Any) -> Any:
    """`obj` as plain JSON data, tagged where JSON alone would lose its type.
    Raises `TypeError` naming any value that is not plain data."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_value(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_value(v) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: encode_value(v) for k, v in obj.items()}
        return {"__dict__": [[encode_value(k), encode_value(v)] for k, v in obj.items()]}
    raise TypeError(
        f"a {type(obj).__name__} cannot be stored in a checkpoint without pickle: the "
        f"non-tensor values of the state (an optimizer's param_groups) must be numbers, "
        f"strings, bools, None, dtypes, or lists, tuples and dicts of them."
    )


def decode_value(obj: Any) -> Any:
    """The inverse of `encode_value`."""
    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple__" in obj:
        return tuple(decode_value(v) for v in obj["__tuple__"])
    if "__dict__" in obj:
        return {_hashable(decode_value(k)): decode_value(v) for k, v in obj["__dict__"]}
    if "__dtype__" in obj:
        return dtype_of(obj["__dtype__"])
    return {k: decode_value(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(map(_hashable, key)) if isinstance(key, list) else key


def value_bytes(obj: Any) -> bytes:
    """One non-tensor value as the UTF-8 JSON of its encoding."""
    return json.dumps(encode_value(obj), separators=(",", ":")).encode()


def value_of(data: bytes) -> Any:
    """The value `value_bytes` wrote. Raises `ValueError` for bytes that are not JSON
    or nest deeper than `json_text.MAX_DEPTH`."""
    return decode_value(json_text.loads(data))


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named `name` ("float32"); `ValueError` for any other name."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def set_path(root: dict, path: tuple, value: Any) -> None:
    """Set `value` at `path` (keys and list indices) inside the nested `root`,
    creating missing dicts and lists on the way (DCP's flattening in reverse)."""
    node = root
    for key, nxt in zip(path[:-1], path[1:], strict=False):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
        elif key not in node:
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


# ---------------------------------------------------------------- metadata


def metadata_bytes(md: Metadata) -> bytes:
    """DCP's `Metadata` of a raw-format save (its `storage_data` maps each index to
    an `Extent`) as UTF-8 JSON."""
    extents = {(i.fqn, tuple(i.offset) if i.offset is not None else None): e for i, e in md.storage_data.items()}
    tensors, objects = {}, {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            chunks = []
            for c in meta.chunks:
                e = extents[(fqn, tuple(c.offsets))]
                chunks.append(
                    {
                        "offsets": list(c.offsets),
                        "sizes": list(c.sizes),
                        "file": e.file,
                        "offset": e.offset,
                        "length": e.length,
                    }
                )
            tensors[fqn] = {
                "dtype": str(meta.properties.dtype).removeprefix("torch."),
                "size": list(meta.size),
                "chunks": chunks,
            }
        else:
            e = extents[(fqn, None)]
            objects[fqn] = {"file": e.file, "offset": e.offset, "length": e.length}
    paths = {fqn: list(p) for fqn, p in (md.planner_data or {}).items()}
    doc = {"version": md.version, "tensors": tensors, "objects": objects, "paths": paths}
    return json.dumps(doc, separators=(",", ":")).encode()


def metadata_of(data: bytes) -> Metadata:
    """DCP's `Metadata` from the JSON `metadata_bytes` wrote. Raises `ValueError`
    (or `KeyError`, `TypeError`, `AttributeError`, `OverflowError`) for a document of
    another shape, or one nested deeper than `json_text.MAX_DEPTH`."""
    doc = json_text.loads(data)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, Extent] = {}
    for fqn, t in doc["tensors"].items():
        props = TensorProperties(dtype=dtype_of(t["dtype"]))
        chunks = []
        for i, c in enumerate(t["chunks"]):
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])))
            storage[MetadataIndex(fqn, c["offsets"], i)] = Extent(str(c["file"]), int(c["offset"]), int(c["length"]))
        state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t["size"]), chunks=chunks)
    for fqn, o in doc["objects"].items():
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = Extent(str(o["file"]), int(o["offset"]), int(o["length"]))
    paths = {fqn: tuple(p) for fqn, p in doc["paths"].items()}
    return Metadata(
        state_dict_metadata=state,
        planner_data=paths,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=doc.get("version"),
    )
