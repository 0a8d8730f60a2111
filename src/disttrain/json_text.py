"""Parsing JSON that someone else may have written (docs/security.md): a checkpoint's
manifest, metadata, `state.json` and RNG files, a run's JSON-lines files.

`json.loads` recurses once per nesting level: a document of 100,000 `[` ends in a
`RecursionError`, and one just under Python's limit makes every later walk over it
recurse as deep. So a document nests at most `MAX_DEPTH` levels, measured on its text
before it is parsed, and any failure to parse is a `ValueError` that its caller turns
into one line naming the file.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64
"""How deeply a document may nest: disttrain's own nest five or six levels (a
config's sections inside `state.json`, a value inside an optimizer's state)."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')
"""A string: to its closing quote, or to the end of what a string may hold (a string
left open hides the brackets after it: a parse fails at it before reaching them).
Every match succeeds where it starts, so `sub` scans each character once; had the
closing quote been required, each quote of an open string full of escaped quotes
would start a scan to the end of the text (quadratic)."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def depth(text: str) -> int:
    """How deeply the JSON text `text` nests (of a text that is not JSON, at least as
    deep as any parse of it would go): the most brackets open at once outside strings.
    Linear, without recursion, and in C but for one dict lookup per bracket."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(data: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `data` (bytes in any encoding `json.loads` takes). Raises
    `ValueError` (a `json.JSONDecodeError`, a `UnicodeDecodeError`, or one saying how
    deep it nests) for what is not JSON or nests deeper than `max_depth`; never
    `RecursionError`."""
    text = data.decode(json.detect_encoding(data)) if isinstance(data, (bytes, bytearray)) else data
    if (text.count("[") + text.count("{") > max_depth) and depth(text) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    return json.loads(text)


def loads_object(data: str | bytes) -> dict | None:
    """The JSON object of `data` (`loads`), or None when `data` is not JSON, nests
    deeper than `MAX_DEPTH`, or holds another kind of value."""
    try:
        value = loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise `ValueError` when the lists and dicts of the parsed `value` nest more
    than `max_depth` levels deep; walked without recursion."""
    todo = [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (list, tuple, dict)):
            if level >= max_depth:
                raise ValueError(f"nested more than {max_depth} levels deep")
            todo += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
