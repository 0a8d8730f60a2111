"""Reading the JSON-lines files a run writes (metrics.jsonl, run_events.jsonl, the
sample audit). Plain Python: the trainer and the torch-free `disttrain report` share it.
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain import json_text
from disttrain.plain_files import MiB, read_plain

JSONL_LIMIT = 512 * MiB
"""The most bytes a run's JSON-lines file may hold to be read (about two million
records of metrics): a larger one (a sparse file, say) is refused before it is read,
as its records would take several times that in memory."""


def read_text(path: str | os.PathLike) -> str | None:
    """The text of a run's JSON-lines file (bytes that are not UTF-8 replaced), or None
    when it does not exist. Raises `plain_files.NotPlainFile` (a `UserError`, one line
    naming it) for a symlink, a file that is not regular (a FIFO: no wait for a writer)
    or one over `JSONL_LIMIT`, before any of it is read."""
    try:
        return read_plain(path, JSONL_LIMIT).decode(errors="replace")
    except FileNotFoundError:
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON-lines file, in file order; [] when it does not exist. A
    line cut short by a kill -9 (or anything that is not a JSON object) is skipped.
    Raises as `read_text` does."""
    text = read_text(Path(path))
    if text is None:
        return []
    out = []
    for line in text.splitlines():
        try:
            item = json_text.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
