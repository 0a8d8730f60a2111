"""Which storage format holds a checkpoint's tensors, and the one place that reads
each, so every reader (a load, `ckpt inspect`, the exports) serves both:

- `raw-1` (`raw_storage`): raw tensor bytes, JSON values, JSON `.metadata`; nothing is
  unpickled. The manifest names it (`"storage": "raw-1"`).
- `dcp`: DCP's default records (`torch.save` per tensor and per value) and its pickled
  `.metadata`, as disttrain wrote checkpoints before `raw-1` (their manifests name no
  storage). Still read, with DCP's own reader.

Call these only after the manifest verified (`layout.verify`).
"""

from __future__ import annotations

from pathlib import Path

from disttrain.checkpoint import layout

DCP_DEFAULT = "dcp"


def storage_of(step_dir: str | Path) -> str:
    """The storage format of the checkpoint `step_dir`, from its manifest."""
    return str(layout.read_manifest(Path(step_dir)).get("storage", DCP_DEFAULT))


def read_metadata(step_dir: str | Path):
    """DCP's `Metadata` of `step_dir`, in either format (a `dcp` one is unpickled)."""
    from disttrain.checkpoint import raw_storage

    if storage_of(step_dir) == raw_storage.FORMAT:
        return raw_storage.read_metadata(step_dir)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(step_dir)).read_metadata()


def load_keys(step_dir: str | Path, keys: set[str]) -> dict:
    """The nested state dict of just `keys` (DCP's flattened names), in one process."""
    from disttrain.checkpoint import raw_storage

    if storage_of(step_dir) == raw_storage.FORMAT:
        return raw_storage.load_keys(step_dir, keys)
    from disttrain.runtime import torch_compat

    return torch_compat.load_keys(keys, checkpoint_id=str(step_dir))
