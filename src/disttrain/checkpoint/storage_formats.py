"""Which storage format holds a checkpoint's tensors, and the one place that reads
each, so every reader (a load, `ckpt inspect`, the exports) serves both:

- `raw-1` (`raw_storage`): raw tensor bytes, JSON values, JSON `.metadata`; nothing is
  unpickled. The manifest names it (`"storage": "raw-1"`).
- `dcp`: DCP's default records (`torch.save` per tensor and per value) and its pickled
  `.metadata`, as disttrain wrote checkpoints before `raw-1` (their manifests name no
  storage). Still read, by DCP's reader made safe (`dcp_read`): only DCP's metadata
  classes are unpickled, values are read weights-only.

Call these only after the manifest verified (`step_folders.verify`).
"""

from __future__ import annotations

from pathlib import Path

from disttrain.checkpoint import step_folders

DCP_DEFAULT = "dcp"


def storage_of(step_dir: str | Path) -> str:
    """The storage format of the checkpoint `step_dir`, from its manifest."""
    return str(step_folders.read_manifest(Path(step_dir)).get("storage", DCP_DEFAULT))


def read_metadata(step_dir: str | Path):
    """DCP's `Metadata` of `step_dir`, in either format (a `dcp` one is unpickled by
    `dcp_read`). Raises `CheckpointUnsafe` or `CheckpointCorrupt` naming the file."""
    from disttrain.checkpoint import raw_storage

    if storage_of(step_dir) == raw_storage.FORMAT:
        return raw_storage.read_metadata(step_dir)
    from disttrain.checkpoint import dcp_read

    return dcp_read.read_metadata(step_dir)


def load_keys(step_dir: str | Path, keys: set[str]) -> dict:
    """The nested state dict of just `keys` (DCP's flattened names), in one process."""
    from disttrain.checkpoint import raw_storage

    if storage_of(step_dir) == raw_storage.FORMAT:
        return raw_storage.load_keys(step_dir, keys)
    from disttrain.checkpoint import dcp_read

    return dcp_read.load_keys(step_dir, keys)


def check_readable(step_dir: str | Path) -> None:
    """Read now what a load parses before any data: the metadata (a `dcp` one by
    `dcp_read`'s restricted unpickler) and, in `dcp`, the globals each value record's
    pickle names (`dcp_read.check_values`; nothing is unpickled). Raises
    `CheckpointUnsafe` or `CheckpointCorrupt` naming the file (`ckpt verify`)."""
    metadata = read_metadata(step_dir)
    if storage_of(step_dir) == DCP_DEFAULT:
        from disttrain.checkpoint import dcp_read

        dcp_read.check_values(step_dir, metadata)
