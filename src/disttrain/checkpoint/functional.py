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

    A collective: every rank calls it with its own `state`. Returns once the
    checkpoint is committed (written, checksummed and renamed into place); keeps every
    checkpoint (use `Checkpointer` for retention and async saves). Raises
    `CheckpointSaveError` on every rank on failure; the previous checkpoint then stays
    the newest and intact.
    """
    path = _for(root, False).save(state)
    assert path is not None, "a synchronous save returns its folder"
    return path


def load(state: TrainState, root: str | Path, *, fallback: bool = False) -> Path | None:
    """`dt.load`: load the newest valid checkpoint under `root` (or the step
    directory `root`) into `state`, resharding to this world size as needed.

    Returns the loaded directory, or None when `root` holds none (a fresh start). A
    collective: every rank calls it. Raises `CheckpointCorrupt` (the newest is damaged
    and `fallback` is off, or none is valid) or `CheckpointMismatch` (another model),
    the same on every rank; after such an error `state` may be partly overwritten, so
    load again or start afresh before training on. `fallback=True` sets a damaged
    newest checkpoint aside and loads the one before it."""
    root = Path(root)
    if root.name.startswith("step-"):
        return _for(root.parent, fallback).load(state, root)
    return _for(root, fallback).load(state)
