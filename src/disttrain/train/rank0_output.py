"""Output that rank 0 alone writes: metrics records as JSON lines, and prints.

Neither is a collective: both are safe in code that only some ranks run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from disttrain.runtime import rank_info
from disttrain.runtime.log import current_rank


class JsonlWriter:
    """Appends one JSON object per line to `path`, on rank 0 only; a no-op elsewhere.

    Rank 0 creates the parent folder at construction. Each `write(record)` opens the
    file, appends `json.dumps(record)` and a newline and closes it, so a kill loses at
    most the line being written (readers skip a cut last line). Not a collective; a
    record that `json` cannot encode raises `TypeError` on rank 0.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.enabled = rank_info().is_main
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        """Append `record` as one line (rank 0); nothing on other ranks."""
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def print_main(*args, **kwargs) -> None:
    """`print(*args, **kwargs)` on global rank 0 only, flushed; other ranks print nothing.
    The rank is the process group's, or before one exists (before `with dt.Job(...)`)
    the launcher's RANK, so a line is printed once per job.

    Not a collective: it never waits for the other ranks, so it is safe in code that
    only some ranks run.
    """
    if current_rank() == 0:
        print(*args, **kwargs, flush=True)
