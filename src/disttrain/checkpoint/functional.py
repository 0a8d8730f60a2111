"""`dt.save` and `dt.load`: checkpoints without a `Checkpointer` of the caller's own.

Each root gets one `Checkpointer` for the life of the process (built on first use, a
collective like its constructor), which keeps every checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from disttrain.checkpoint.checkpointer import Checkpointer
from disttrain.checkpoint.state import TrainState

_checkpointers: dict[Path, Checkpointer] = {}


def _for(root: str | Path, fallback: bool) -> Checkpointer:
    key = Path(root).resolve()
    if key not in _checkpointers:
        _checkpointers[key] = Checkpointer(key, keep_last=0)
    _checkpointers[key].fallback = fallback
    return _checkpointers[key]


def save(state: TrainState, root: str | Path) -> Path:
    """`dt.save`: a synchronous checkpoint of `state` as `root/step-{state.step:08d}`.

    A collective; keeps every checkpoint (use `Checkpointer` for retention and
    async). Raises `CheckpointSaveError` on every rank on failure.
    """
    return _for(root, False).save(state)


def load(state: TrainState, root: str | Path, *, fallback: bool = False) -> Path | None:
    """`dt.load`: load the newest valid checkpoint under `root` (or the step
    directory `root`) into `state`. Returns the directory, or None when `root`
    holds none. A collective; errors as `Checkpointer.load`."""
    root = Path(root)
    if root.name.startswith("step-"):
        return _for(root.parent, fallback).load(state, root)
    return _for(root, fallback).load(state)
