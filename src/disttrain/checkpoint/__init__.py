"""Checkpoints that cannot lie: complete, atomic, verified, async, reshardable,
exportable (P-CKPT-1..5, P-FSDP-8).

- `state`: `TrainState`, everything a resume needs behind one `state_dict`;
  `zero_state`: ZeRO-1 optimizer state without consolidation.
- `step_folders`: step directories, the manifest, verification, "latest", fencing, retention.
- `checkpointer`: save/load across ranks with DCP, sync or async; `functional`:
  `save`/`load` without a `Checkpointer`; `load_phases`: where a load's time went.
- `raw_storage` (the storage format `raw-1`: raw tensor bytes, JSON values and JSON
  metadata under DCP's planner) and `json_records`; `storage_formats`: which format a
  checkpoint is in, and its readers (checkpoints of DCP's default format still load,
  through `dcp_read`, which unpickles only DCP's metadata classes).
- `hashing_fs` and `digests`: the verified load, checksums computed while writing and
  reading.
- `compat`: does a checkpoint fit the state it is loaded into; one-line failures.
- `checkpoint_errors`: the errors, each naming the file and the fix.
- `export`: consolidated safetensors export and inspection, offline, tensor by tensor;
  `hf_export`: a Hugging Face model folder.
- `ckpt_command`: `disttrain ckpt inspect|verify|export`.
- `fault_points`: the `DISTTRAIN_FAULT` points inside a save, for crash tests.
- `files`: atomic single files (`save_model`/`load_model` for plain weights).
- `finite_tensors`: which tensors hold a NaN or an infinity; `check_finite(loss_or_tensors,
  step)`, the check a loop calls before a save.

Trust: a checkpoint is read only after its JSON manifest verifies (sizes and
xxh3_128 digests of every file; manifests of older versions carry sha256). A
checkpoint of the `raw-1` format is never unpickled: its metadata and non-tensor
values are JSON, its tensors raw bytes. Older checkpoints (DCP's default format) hold
pickles; the manifest proves they are the bytes the writer produced, not that the
writer was honest, so `dcp_read` resolves only DCP's metadata classes and reads
values weights-only. No file outside the step folder is read (`own_files`): a folder
that asks for either is refused (`CheckpointUnsafe`). Share models as the safetensors
export.
"""

from disttrain.checkpoint.checkpoint_errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointSaveError,
    CheckpointUnsafe,
    StaleWriterError,
)
from disttrain.checkpoint.checkpointer import Checkpointer
from disttrain.checkpoint.files import atomic_torch_save, load_model, save_model, strip_prefix
from disttrain.checkpoint.finite_tensors import NonFiniteError, check_finite
from disttrain.checkpoint.functional import load, save
from disttrain.checkpoint.state import TrainState
from disttrain.checkpoint.step_folders import latest_valid, verify

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointSaveError",
    "CheckpointUnsafe",
    "Checkpointer",
    "NonFiniteError",
    "StaleWriterError",
    "TrainState",
    "atomic_torch_save",
    "check_finite",
    "latest_valid",
    "load",
    "load_model",
    "save",
    "save_model",
    "strip_prefix",
    "verify",
]
