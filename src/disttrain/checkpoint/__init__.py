"""Checkpoints that cannot lie: complete, atomic, verified, async, reshardable,
exportable (P-CKPT-1..5, P-FSDP-8).

- `state`: `TrainState`, everything a resume needs behind one `state_dict`.
- `layout`: step directories, the manifest, verification, "latest", fencing, retention.
- `checkpointer`: save/load across ranks with DCP, sync or async; `save`/`load`.
- `export`: consolidated safetensors export and inspection, offline, tensor by tensor.
- `faults`: the `DISTTRAIN_FAULT` hooks the crash tests use.
- `files`: atomic single files (`save_model`/`load_model` for plain weights).
- `finite`: `check_finite(loss_or_tensors, step)`, the guard a loop calls before a save.

Trust: a checkpoint is read only after its JSON manifest verifies (sizes and
sha256 of every file). DCP's `.metadata` and the optimizer's non-tensor values
are pickles that DCP itself unpickles; the manifest proves they are the bytes the
writer produced, not that the writer was honest. Load checkpoints you or your
jobs wrote; share models as the safetensors export.
"""

from disttrain.checkpoint.checkpointer import Checkpointer, load, save
from disttrain.checkpoint.checkpoint_errors import (CheckpointCorrupt, CheckpointError, CheckpointMismatch,
                                         CheckpointSaveError, StaleWriterError)
from disttrain.checkpoint.files import atomic_torch_save, load_model, save_model, strip_prefix
from disttrain.checkpoint.finite import NonFiniteError, check_finite
from disttrain.checkpoint.layout import latest_valid, verify
from disttrain.checkpoint.state import TrainState

__all__ = [
    "CheckpointCorrupt", "CheckpointError", "CheckpointMismatch", "CheckpointSaveError",
    "Checkpointer", "NonFiniteError", "StaleWriterError", "TrainState", "atomic_torch_save",
    "check_finite", "latest_valid", "load",
    "load_model", "save", "save_model", "strip_prefix", "verify",
]
