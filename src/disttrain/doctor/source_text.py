"""The text of a Python file as Python itself reads it: the encoding from a BOM or a
`# -*- coding: NAME -*-` line (PEP 263), else UTF-8. So a valid script saved with a
BOM or in latin-1 with its coding line is checked, not refused."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from disttrain.errors import UserError


def read_source(path: Path) -> str:
    """The decoded source of `path`. Raises `OSError` for an unreadable file and
    `UnicodeDecodeError` for bytes its declared encoding cannot decode; `UserError`
    for an unknown encoding name in its coding line."""
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as e:  # an unknown codec, or a BOM with another coding line
        raise UserError(f"{path}: {e.msg if hasattr(e, 'msg') else e}; fix its coding line") from None
    return raw.decode(encoding)
