"""Which files a checkpoint folder may make disttrain read: its own, by plain name
(docs/checkpoints.md, "What a checkpoint folder can make disttrain do").

A manifest names each file of its step folder; the metadata names the data files.
Both are written by whoever wrote the folder, so a name is checked before it is
opened: no separator, no `..`, not absolute (`name_problem`), not a symlink out of
the folder (`escapes`), and a data file is one the manifest lists (`check_listed`).
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain.checkpoint.checkpoint_errors import CheckpointUnsafe


def name_problem(name: str) -> str | None:
    """Why `name`, a manifest's file name, is not a plain name of a file in its step
    folder (a separator, `..`, an absolute path, empty), or None."""
    if not name or name in (".", ".."):
        return "which is no file name"
    if os.path.isabs(name) or "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        return "a path, not a plain name"
    if "\0" in name:
        return "which holds a NUL"
    return None


def escapes(step_dir: Path, name: str) -> bool:
    """True when `step_dir/name` is a symlink whose target is not a file of `step_dir`
    itself (disttrain never writes a symlink; the folder may be reached through one)."""
    path = step_dir / name
    if not path.is_symlink():
        return False
    return Path(os.path.realpath(path)).parent != Path(os.path.realpath(step_dir))


def escape_message(step_dir: Path, name: str) -> str:
    return (
        f"{step_dir / name} is a symlink to {os.path.realpath(step_dir / name)}, outside "
        f"{step_dir}: refused, it is not read. A checkpoint's files are its own."
    )


def check_listed(files: dict, names, *, by: Path) -> None:
    """Raise `CheckpointUnsafe` unless each of `names` (the data files that `by`, a
    checkpoint's metadata, points the reader to) is in `files` (its manifest's
    records): a name outside them is never opened."""
    for name in names:
        if not isinstance(name, str) or name not in files:
            raise CheckpointUnsafe(
                f"{by} points to the data file {name!r}, which its manifest does not "
                f"list: refused, it is not read. The metadata was altered.",
                by.name,
            )
