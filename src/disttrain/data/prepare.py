"""`disttrain data prepare`: text files -> token files that `[data] tokens` reads.

One token file per text file, named after its path below the inputs' common folder
(`a/b.txt` -> `a__b.bin`), in llm.c's format by default (a header that holds the
token count, so a truncated file is caught) or nanoGPT's raw one. Tokens are the
file's bytes (vocabulary 256), or the ids of a local Hugging Face `tokenizers` file
(tokenizer.json; nothing is downloaded).

Resumable by file, one process, no process group: each file is written under a
temporary name and renamed when complete, and `meta.json` records its source (size,
mtime), tokenizer and token count. A second run skips every file whose record still
matches, so a killed run redoes at most the file it was writing. Run one prepare
per output folder at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from disttrain.data.token_files import LLMC_HEADER_INTS, LLMC_MAGIC, META, read_meta, read_token_file
from disttrain.errors import UserError

if TYPE_CHECKING:
    from rich.progress import Progress

CHUNK_BYTES = 4 << 20
"""Text read per tokenizer call. Tokenizer input is cut at a line end, so a token
never spans two calls unless a single line is longer than this."""


@dataclass
class PrepareReport:
    """What one `prepare` call did: files written and skipped, tokens written."""

    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    tokens: int = 0
    vocab_size: int = 256


class _Bytes:
    """The byte 'tokenizer': every byte is its own token."""

    vocab_size, name, fingerprint = 256, "bytes", "bytes"

    def chunks(self, path: Path) -> Iterator[tuple[np.ndarray, int]]:
        with path.open("rb") as f:
            while block := f.read(CHUNK_BYTES):
                yield np.frombuffer(block, dtype=np.uint8), len(block)


class _HFTokenizer:
    """A local Hugging Face `tokenizers` file; text is read as UTF-8 (bad bytes replaced)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(
                "--tokenizer needs the `tokenizers` package: pip install tokenizers (or disttrain[data])."
            ) from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # a file the library cannot parse is the user's to fix
            raise UserError(
                f"--tokenizer {path}: not a Hugging Face tokenizer.json file ({type(e).__name__}: {str(e)[:200]})."
            ) from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.name = path.name
        self.fingerprint = hashlib.sha1(path.read_bytes()).hexdigest()

    def chunks(self, path: Path) -> Iterator[tuple[np.ndarray, int]]:
        with path.open("rb") as f:
            rest = b""
            while True:
                block = f.read(CHUNK_BYTES)
                data = rest + block
                cut = data.rfind(b"\n") + 1 if block else len(data)
                text, rest = (data[:cut], data[cut:]) if cut else (data, b"")
                if text:
                    ids = self.tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
                    yield np.asarray(ids, dtype=np.int64), len(text)
                if not block:
                    return


def output_names(texts: list[Path]) -> dict[Path, str]:
    """Each input's token-file name: its path below the common folder, '/' -> '__',
    suffix -> '.bin'. Raises `UserError` for a missing input, a folder, or two inputs
    that would share a name."""
    for p in texts:
        if p.is_dir():
            raise UserError(f"disttrain data prepare: {p} is a folder; pass its files (for example {p}/*.txt).")
        if not p.is_file():
            raise UserError(f"disttrain data prepare: input {p} does not exist.")
    # absolute, not resolved: a symlinked input keeps the name it was given
    full = list(dict.fromkeys(Path(os.path.abspath(p)) for p in texts))
    common = Path(os.path.commonpath([str(p.parent) for p in full]))
    names: dict[Path, str] = {}
    for f in full:
        name = "__".join(f.relative_to(common).with_suffix(".bin").parts)
        if name in names.values():
            raise UserError(
                f"disttrain data prepare: two inputs would both be written as {name}; "
                f"rename one, or prepare them into different --out folders."
            )
        names[f] = name
    return names


def _dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def write_token_file(path: Path, chunks: Iterator[np.ndarray], dtype: type, fmt: str = "llmc") -> int:
    """Write the tokens of `chunks` to `path` atomically (a temporary name, fsync, then
    `os.replace`) and return their count. `fmt` is 'llmc' (header) or 'nanogpt' (raw)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    count = 0
    try:
        with tmp.open("wb") as f:
            if fmt == "llmc":
                f.write(b"\0" * (LLMC_HEADER_INTS * 4))  # the count is known at the end
            for ids in chunks:
                f.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                count += len(ids)
            if fmt == "llmc":
                header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
                header[:3] = [LLMC_MAGIC, 1 if dtype == np.uint16 else 2, count]
                f.seek(0)
                f.write(header.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def _record(src: Path, tokenizer, tokens: int) -> dict:
    st = src.stat()
    return {
        "source": str(src),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "tokenizer": tokenizer.fingerprint,
        "tokens": tokens,
    }


def _is_done(out_file: Path, src: Path, record: dict | None, tokenizer, fmt: str) -> bool:
    if not record or not out_file.is_file():
        return False
    fresh = _record(src, tokenizer, record.get("tokens", -1))
    if any(record.get(k) != fresh[k] for k in ("source", "size", "mtime_ns", "tokenizer")):
        return False
    try:
        tf = read_token_file(out_file, "uint16" if _dtype(tokenizer.vocab_size) == np.uint16 else "uint32")
    except UserError:
        return False
    return tf.count == record["tokens"] and tf.format == fmt


def _write_meta(out: Path, meta: dict) -> None:
    tmp = out / f".{META}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, out / META)


def prepare(
    texts: list[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | None = None,
    fmt: str = "llmc",
    progress: bool = True,
) -> PrepareReport:
    """Tokenize `texts` into `out` (created); skip files already written for the same
    source and tokenizer. Raises `UserError` for a missing input, a bad tokenizer
    file, an unknown format, or an output folder prepared with other settings."""
    if fmt not in ("llmc", "nanogpt"):
        raise UserError(f"--format {fmt!r} is unknown; choose llmc (a header with the count) or nanogpt (raw).")
    if not texts:
        raise UserError("disttrain data prepare needs at least one text file.")
    tok = _HFTokenizer(Path(tokenizer)) if tokenizer else _Bytes()
    names = output_names([Path(t) for t in texts])
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".*.tmp-*"):  # a killed run's partial file
        stale.unlink(missing_ok=True)
    meta = read_meta(out_dir)
    dtype = _dtype(tok.vocab_size)
    settings = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "format": fmt, "dtype": np.dtype(dtype).name}
    if meta.get("files") and any(meta.get(k) != v for k, v in settings.items() if k != "tokenizer"):
        raise UserError(
            f"--out {out_dir} was prepared with { ({k: meta.get(k) for k in settings}) }, this run "
            f"asks for {settings}; use another --out folder (token files of two "
            f"vocabularies cannot train one model)."
        )
    meta = {**settings, "files": dict(meta.get("files", {}))}
    report = PrepareReport(vocab_size=tok.vocab_size)
    todo = []
    for src, name in names.items():
        if _is_done(out_dir / name, src, meta["files"].get(name), tok, fmt):
            report.skipped.append(name)
        else:
            todo.append((src, name))
    with _progress_bar(progress, sum(src.stat().st_size for src, _ in todo)) as advance:
        for src, name in todo:

            def chunks(src=src, name=name):
                for ids, nbytes in tok.chunks(src):
                    yield ids
                    advance(nbytes, name)

            count = write_token_file(out_dir / name, chunks(), dtype, fmt)
            meta["files"][name] = _record(src, tok, count)
            _write_meta(out_dir, meta)  # after the rename: a record always names a whole file
            report.written.append(name)
            report.tokens += count
    if not todo:
        _write_meta(out_dir, meta)
    return report


class _progress_bar:
    """A rich bar over input bytes (`advance(nbytes, name)`); a no-op when disabled."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled and total > 0, total
        self._bar: Progress | None = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            bar = self._bar = Progress(
                TextColumn("[bold]prepare[/] {task.fields[name]}"), BarColumn(), DownloadColumn(), TimeRemainingColumn()
            )
            bar.start()
            self._task = bar.add_task("prepare", total=self.total, name="")
        return self.advance

    def advance(self, nbytes: int, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=nbytes, name=name)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
