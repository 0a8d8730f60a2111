"""Which files a checkpoint folder may make disttrain read: its own, by plain name
(docs/checkpoints.md, "What a checkpoint folder can make disttrain do").

A manifest names each file of its step folder; the metadata names the data files.
Both are written by whoever wrote the folder, so a name is checked before it is
opened: no separator, no `..`, not absolute (`name_problem`), not a symlink out of
the folder (`escapes`), and a data file is one the manifest lists (`check_listed`).
Each file is then opened once (`open_own`, `read_own`): no symlink followed, a regular
file of the size its manifest records (or a bound), read, hashed and parsed from that
one descriptor, so a file swapped after its check is never what is read.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from disttrain.checkpoint.checkpoint_errors import CheckpointCorrupt, CheckpointUnsafe
from disttrain.checkpoint.digests import bytes_mismatch, corrupt_message
from disttrain.plain_files import MiB, NotPlainFile, open_plain, read_at_most


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


SMALL_LIMIT = 16 * MiB
"""The bound of a checkpoint file that no manifest record sizes (`manifest.json`
itself, `WRITER.json`): a manifest of 100,000 files is about 12 MiB."""


def open_own(step_dir: Path, name: str, want: dict | None = None, limit: int | None = SMALL_LIMIT) -> io.FileIO:
    """Open the file `name` of `step_dir` once, for every read, hash and parse of it
    (`plain_files.open_plain`: no symlink followed, a regular file), checked on the
    open descriptor to hold `want["size"]` bytes (its manifest record) or, without
    one, at most `limit` bytes. The caller closes it.

    Raises `CheckpointUnsafe` for a symlink or a file that is not regular or over its
    bound, `CheckpointCorrupt` for a size other than the record's, `OSError`
    (`FileNotFoundError` for a missing file) when it cannot be opened."""
    path = step_dir / name
    try:
        f = open_plain(path, limit if want is None else None)
    except NotPlainFile as e:
        raise CheckpointUnsafe(f"{e} A checkpoint's files are regular files of its own folder.", name) from None
    if want is not None and (size := os.fstat(f.fileno()).st_size) != want.get("size"):
        f.close()
        raise CheckpointCorrupt(corrupt_message(path, size, want), name)
    return f


def read_own(step_dir: Path, name: str, want: dict | None = None, limit: int = SMALL_LIMIT) -> bytes:
    """The bytes of the file `name` of `step_dir`, read from the one descriptor
    `open_own` opened and checked; with `want` (its manifest record) hashed from those
    very bytes and compared with the record, so what the caller parses is what was
    checked. Raises `CheckpointUnsafe` or `CheckpointCorrupt` naming the file."""
    path = step_dir / name
    with open_own(step_dir, name, want, limit) as f:
        try:
            data = read_at_most(f, limit if want is None else int(want["size"]), path)
        except NotPlainFile as e:
            raise CheckpointCorrupt(f"{e} It changed while it was read.", name) from None
    if want is not None and (bad := bytes_mismatch(data, want, path)) is not None:
        raise CheckpointCorrupt(bad, name)
    return data
