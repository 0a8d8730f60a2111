"""The config keys that name a file or folder, and the one rule for a relative one:

- in a TOML file: relative to the folder of that file;
- in a `--section.key=value` override: relative to the current folder;
- a key left at its default: as it stands, so relative to the current folder.

`load_config` applies the rule once, as it reads each value: a relative path becomes
absolute there, so the `Config` it returns (and the copy each checkpoint stores) names
the same files from whichever folder a command runs, and no later code joins a base
again (a `Config` built in Python, as `dt.Job` takes it, has no file: its relative
paths are the current folder's). A leading `~` is the home folder; an empty value
keeps its meaning (the key's default behaviour). A 'module:callable' reference is not
a path: its module is looked up in the config file's folder, then `sys.path`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PATH_KEYS: tuple[str, ...] = (
    "train.out_dir",
    "checkpoint.dir",
    "guard.dir",
    "data.tokens",
    "data.tokens_heldout",
    "data.hf_dataset",
    "model.hf_path",
)
"""Every config key whose value is a local file, folder or glob."""

RULE = (
    "Relative paths ({keys}): in CONFIG.toml, relative to the folder of CONFIG.toml; "
    "in --section.key=VALUE, relative to the current folder; a key left at its default, "
    "relative to the current folder. Each is made absolute as the config is read."
)
"""The rule in words, for `disttrain train --help` (and so the command-line reference)."""


def rule_text() -> str:
    """`RULE` naming every key of `PATH_KEYS`."""
    return RULE.format(keys=", ".join(PATH_KEYS))


def anchored(value: str, base: str | os.PathLike) -> str:
    """`value` as an absolute path: `~` expanded, a relative path joined to `base`
    (resolved, so that a `..` in `value` leaves the real folder) and normalised. An
    absolute value is returned as written (after `~`)."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    return os.path.normpath(Path(base).resolve() / p)


def anchor_paths(raw: dict, base: str | os.PathLike) -> dict:
    """Make every non-empty string under a `PATH_KEYS` key of the raw config tree `raw`
    absolute against `base` (in place, and returned). Values of other types are left
    for the type check to refuse."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        table = raw.get(section)
        if isinstance(table, dict) and isinstance(table.get(name), str) and table[name].strip():
            table[name] = anchored(table[name], base)
    return raw


def anchor_override(key: str, value: Any, base: str | os.PathLike) -> Any:
    """The value of the override `--key=value` with its paths made absolute against
    `base`: a path key's string, or a whole section given as a table."""
    parts = key.split(".")
    tree: dict = {}
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    anchor_paths(tree, base)
    return node[parts[-1]]


def same_place(key: str, stored: Any, now: Any) -> bool:
    """Whether a checkpoint's stored value of `key` and this run's name the same place.

    Equal values do. A checkpoint written before paths were made absolute stored a path
    key as the TOML wrote it, relative to a folder it did not record: this run's
    absolute path counts as the same place when it ends with that relative path (its
    leading `..` dropped), which is all that checkpoint can tell."""
    if stored == now:
        return True
    if key not in PATH_KEYS or not (isinstance(stored, str) and isinstance(now, str)):
        return False
    if not stored.strip() or os.path.isabs(stored) or stored.startswith("~") or not os.path.isabs(now):
        return False
    tail = tuple(part for part in Path(os.path.normpath(stored)).parts if part != "..")
    parts = Path(os.path.normpath(now)).parts
    return len(tail) <= len(parts) and parts[len(parts) - len(tail) :] == tail
