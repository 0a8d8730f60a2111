"""Reading the JSON-lines files a run writes (metrics.jsonl, run_events.jsonl, the
sample audit). Plain Python: the trainer and the torch-free `disttrain report` share it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a JSON-lines file, in file order; [] when it does not exist. A
    line cut short by a kill -9 (or anything that is not a JSON object) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
