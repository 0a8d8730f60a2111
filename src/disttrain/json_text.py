"""Parsing JSON that someone else may have written (docs/security.md): a checkpoint's
manifest, metadata, `state.json` and RNG files, a run's JSON-lines files.

`json.loads` recurses once per nesting level: a document of 100,000 `[` ends in a
`RecursionError`, and one just under Python's limit makes every later walk over it
recurse as deep. So a document nests at most `MAX_DEPTH` levels, and any failure to
parse is a `ValueError` that its caller turns into one line naming the file.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""How deeply a document may nest: disttrain's own nest five or six levels (a
config's sections inside `state.json`, a value inside an optimizer's state)."""


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `data` (bytes must be UTF-8). Raises `ValueError` (a
    `json.JSONDecodeError`, a `UnicodeDecodeError`, or one saying how deep it nests)
    for what is not JSON or nests deeper than `max_depth`; never `RecursionError`."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    opens = data.count("[") + data.count("{") if isinstance(data, str) else data.count(b"[") + data.count(b"{")
    if opens > max_depth:  # only then can it nest that deep: skip the walk otherwise
        check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise `ValueError` when the lists and dicts of `value` nest more than
    `max_depth` levels deep; walked without recursion."""
    todo = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth >= max_depth:
                raise ValueError(f"nested more than {max_depth} levels deep")
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
