"""Offline export and inspection of a committed checkpoint (P-CKPT-4, P-FSDP-8).

`export_safetensors` writes a consolidated, prefix-free model file that a plain
single-device model loads with `load_state_dict(strict=True)`. It needs no process
group and never holds the whole model: the header is computed from DCP's metadata
(names, global shapes, dtypes), then each tensor is gathered from its shards with
DCP's single-process reader, written, and dropped. Peak memory is one tensor.
Everything runs only after the manifest verified.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from disttrain.checkpoint import step_folders
from disttrain.checkpoint.files import atomic_torch_save
from disttrain.checkpoint.storage_formats import load_keys, read_metadata
from disttrain.config.paths import output_file
from disttrain.errors import UserError

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensor_table(step_dir: Path) -> list[tuple[str, tuple, torch.dtype, int]]:
    """(key, global shape, dtype, bytes) of every tensor in the checkpoint.
    Verifies the manifest first; raises `CheckpointCorrupt` naming a bad file."""
    step_folders.verify(step_dir)
    md = read_metadata(step_dir).state_dict_metadata
    rows = []
    for key, meta in sorted(md.items()):
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            numel = 1
            for d in meta.size:
                numel *= d
            rows.append((key, tuple(meta.size), dtype, numel * dtype.itemsize))
    return rows


def read_one(step_dir: Path, key: str) -> torch.Tensor:
    with warnings.catch_warnings():  # "no process group: single process" is the intent here
        warnings.simplefilter("ignore")
        sd = load_keys(step_dir, {key})
    for part in key.split("."):  # DCP returns the nested form of the flattened key
        sd = sd[part] if isinstance(sd, dict) and part in sd else sd
    if isinstance(sd, dict):
        sd = _find(sd)
    return sd


def _find(tree):
    while isinstance(tree, dict):
        (tree,) = tree.values()
    return tree


def is_disttrain_export(path: Path) -> bool:
    """True for a safetensors file that `export_safetensors` wrote (its header says
    source "disttrain"): the only existing file an export may replace."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100_000_000:
                return False
            header = json.loads(f.read(n))
        return header.get("__metadata__", {}).get("source") == "disttrain"
    except (OSError, ValueError, AttributeError):
        return False


def export_safetensors(
    step_dir: str | os.PathLike, to: str | os.PathLike, optim_to: str | os.PathLike | None = None
) -> dict:
    """Write the model as one safetensors file, tensor by tensor; optionally the full
    optimizer state (consolidated, fqn-keyed) as a torch file loadable with
    `weights_only=True`. Returns a summary. Raises `UserError` for a bad directory, or
    for a target that exists (only an earlier disttrain export at `to` is replaced) or
    cannot be written; the checks run before anything is written.
    """
    step_dir = Path(step_dir)
    to = output_file(to, "--to", replaceable=is_disttrain_export)
    if optim_to is not None:
        optim_to = output_file(optim_to, "--optim")
        if Path(optim_to).resolve() == to.resolve():
            raise UserError(f"--to and --optim both name {to}; give them two different files.")
    rows = [r for r in tensor_table(step_dir) if r[0].startswith("model.")]
    if not rows:
        raise UserError(f"{step_dir} holds no model tensors; is it a disttrain checkpoint?")
    header, offset = {}, 0
    for key, shape, dtype, nbytes in rows:
        if dtype not in _ST_DTYPES:
            raise UserError(f"{key} has dtype {dtype}, which safetensors cannot store.")
        header[key[len("model.") :]] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    manifest = step_folders.read_manifest(step_dir)
    header["__metadata__"] = {"format": "pt", "step": str(manifest.get("step")), "source": "disttrain"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{to.name}.", suffix=".tmp", dir=to.parent)
    except OSError as e:
        raise UserError(f"cannot write --to {to}: {e.strerror or e}.") from None
    tmp = Path(tmp_name)  # a fresh name: never an existing file beside the target
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for key, shape, dtype, _ in rows:
                t = read_one(step_dir, key).detach().to("cpu").contiguous()
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise UserError(f"{key}: read {tuple(t.shape)} {t.dtype}, metadata says {shape} {dtype}.")
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                del t  # one tensor in memory at a time
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, to)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write --to {to}: {e.strerror or e}; nothing was written.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    summary = {"tensors": len(rows), "bytes": offset, "to": str(to)}
    if optim_to is not None:
        try:
            summary["optimizer"] = str(export_optimizer(step_dir, optim_to))
        except OSError as e:
            raise UserError(f"cannot write --optim {optim_to}: {e.strerror or e}.") from None
    return summary


def export_optimizer(step_dir: Path, to: str | os.PathLike) -> Path:
    """The full optimizer state {'state': {fqn: {...}}, 'param_groups': [...]} as a
    torch file (param ids replaced by parameter names). Holds the whole optimizer
    state in memory: it is asked for explicitly."""
    keys = {r[0] for r in tensor_table(step_dir) if r[0].startswith("optim.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = load_keys(step_dir, keys | {"optim.param_groups"})
    return atomic_torch_save(sd.get("optim", sd), to)
