"""Atomic single files: model weights and small JSON/bytes records (P-CKPT-2, P-CKPT-4).

Rank 0 writes the unwrapped model's state dict (no `module.` prefix) to a temporary
name in the target directory, flushes it to disk, then `os.replace`s it over the
final name: a crash leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from disttrain.errors import UserError
from disttrain.runtime import barrier, rank_info
from disttrain.runtime.log import LOGGER
from disttrain.runtime.torch_compat import canonical_name, unwrap


def _atomic_write(path: str | os.PathLike, write) -> Path:
    """Call `write(file)` on a temp file beside `path`, fsync, then `os.replace`.

    A crash leaves the old file or the new one. Raises `OSError` (ENOSPC included)
    after removing the temp file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_torch_save(obj, path: str | os.PathLike) -> Path:
    """`torch.save(obj)` to a temp file beside `path`, fsync, then `os.replace` (P-CKPT-2).

    A crash at any moment leaves either the old file or the complete new one, never a
    torn file. Creates the parent folder. Returns `path`. Not a collective: every
    caller writes (call it on one rank). An error while writing (`OSError`, a full
    disk included, or a pickling error) removes the temp file and propagates; the old
    file is untouched.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_bytes(data: bytes, path: str | os.PathLike) -> Path:
    """Write `data` atomically over `path` (see `_atomic_write`)."""
    return _atomic_write(path, lambda f: f.write(data))


def fsync_file(path: str | os.PathLike) -> None:
    """fsync the written file at `path` (its data and size reach the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a power loss (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename still happened
        pass
    finally:
        os.close(fd)


def full_model_state(model: nn.Module) -> dict:
    """Plain, full tensors with the user's names, whatever the strategy (P-FSDP-8).

    Sharded models (FSDP2 DTensors, FSDP1) are gathered with torch's
    `get_model_state_dict(full_state_dict=True)`: a collective, every rank must call it,
    and only rank 0 receives the tensors. A tensor-parallel shard (a DTensor) outside
    FSDP, under DDP, is gathered whole on every rank (a collective too). Plain DDP and
    plain modules need no communication.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = fsdp is not None and isinstance(model, (fsdp.FSDPModule, fsdp.FullyShardedDataParallel))
    if not sharded:
        state = unwrap(model).state_dict()
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # FSDP1 crashes on CPU when asked to offload a full state dict; FSDP2 does not.
    assert fsdp is not None  # sharded implies it was imported
    offload = not isinstance(model, fsdp.FullyShardedDataParallel)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def save_model(model: nn.Module, path: str | os.PathLike, strip: str = "") -> Path:
    """Rank 0 saves the full, prefix-free weights atomically; every rank waits for it.

    A collective (a gather under FSDP, then a barrier): every rank must call it. The
    file loads into the plain model with `load_state_dict(strict=True)`; with `strip`
    (an adapter's prefix, such as "hf."), into the adapted model's own class instead.
    The write is atomic (`atomic_torch_save`): a failure on rank 0 (a full disk) leaves
    any earlier file intact and raises there, while the other ranks wait at the barrier
    until the group's timeout.
    """
    path = Path(path)
    state = full_model_state(model)
    if strip:
        state = strip_prefix(state, strip)
    if rank_info().is_main:
        atomic_torch_save(state, path)
    barrier()
    return path


def strip_prefix(state: dict, prefix: str = "module.") -> dict:
    """`state` with `prefix` removed once from the front of each key that has it (DDP's
    `module.`, or an adapter's prefix such as `save_model`'s `strip="hf."`), so a model
    without that prefix can load the dict. Other keys are kept as they are.

    Not built on `torch_compat.canonical_name`: that removes every wrapper's parts and
    nothing else, while this removes exactly the one prefix asked for, whatever it is.
    `load_model` reads wrapped names through `canonical_name`."""
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


def model_keys(state: dict, model: nn.Module) -> dict:
    """`state` with each key that `model.state_dict()` lacks renamed to the model's key
    of the same canonical name (`torch_compat.canonical_name`): a dict saved from a
    wrapped model (DDP's `module.`, `torch.compile`'s `_orig_mod.`, FSDP1's or the
    checkpoint wrapper's parts, in any nesting) gets the model's own names, also where
    the model has a submodule of its own called `module`. A key with no counterpart is
    kept (the strict load then names it)."""
    own = list(model.state_dict())
    by_canonical = {canonical_name(k): k for k in own}
    known = set(own)
    return {k if k in known else by_canonical.get(canonical_name(k), k): v for k, v in state.items()}


def load_model(model: nn.Module, path: str | os.PathLike) -> None:
    """Load weights saved by `save_model`, or a state dict saved from a wrapped model
    (DDP's `module.`, `torch.compile`'s `_orig_mod.`, in any nesting), into `model`.

    Reads on CPU with `weights_only=True` (nothing is unpickled beyond tensors) and
    loads strict into the module inside any wrapper (`dt.unwrap`), the file's wrapper
    name parts mapped to the model's names (`model_keys`). Not a collective: each rank
    reads the file itself. Raises `UserError` naming the file for a missing file or
    mismatched keys or shapes (the first lines of torch's list); torch copies the
    tensors that match before it refuses, so after that error load a matching file
    before using the model.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint file not found: {path}.")
    state = torch.load(path, map_location="cpu", weights_only=True)
    target = unwrap(model)
    renamed = model_keys(state, target)
    if list(renamed) != list(state):
        LOGGER.info(
            f"note: {path} has a wrapper's names (DDP's 'module.', torch.compile's '_orig_mod.'); "
            f"they were mapped to the model's names for loading (P-CKPT-4)."
        )
    try:
        target.load_state_dict(renamed, strict=True)
    except RuntimeError as e:
        first = "\n".join(str(e).splitlines()[:6])
        raise UserError(f"{path} does not match the model:\n{first}") from None
