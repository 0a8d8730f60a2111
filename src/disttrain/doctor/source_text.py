"""The text of a Python file as Python itself reads it: the encoding from a BOM or a
`# -*- coding: NAME -*-` line (PEP 263), else UTF-8. So a valid script saved with a
BOM or in latin-1 with its coding line is checked, not refused."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

from disttrain.errors import UserError
from disttrain.plain_files import MiB, read_plain

SOURCE_LIMIT = 16 * MiB
"""The most bytes a file doctor checks may hold (some 400,000 lines of Python)."""


def read_source(path: Path) -> str:
    """The decoded source of `path`. Raises `OSError` for an unreadable file and
    `UnicodeDecodeError` for bytes its declared encoding cannot decode; `UserError`
    for an unknown encoding name in its coding line, and (`plain_files.NotPlainFile`,
    before anything is read) for a path that is no regular file once symlinks are
    followed (a FIFO: no wait for a writer) or holds over `SOURCE_LIMIT` bytes."""
    raw = read_plain(path, SOURCE_LIMIT, follow=True)  # a user's script may be a symlink
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as e:  # an unknown codec, or a BOM with another coding line
        raise UserError(f"{path}: {e.msg if hasattr(e, 'msg') else e}; fix its coding line") from None
    return raw.decode(encoding)
