"""Token files for the data tests: llm.c's headered format and nanoGPT's raw one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from disttrain.data.token_files import LLMC_MAGIC


def write_llmc(path: Path, tokens, version: int = 1, count: int | None = None) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[:3] = [LLMC_MAGIC, version, len(tokens) if count is None else count]
    dtype = np.uint16 if version == 1 else np.uint32
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())
    return path


def write_raw(path: Path, tokens, dtype=np.uint16) -> Path:
    path.write_bytes(np.asarray(tokens, dtype=dtype).tobytes())
    return path
