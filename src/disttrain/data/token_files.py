"""Token files on disk as a map-style dataset: nanoGPT's raw `train.bin` and llm.c's
headered shards, memory-mapped, cut into `block_size + 1` windows.

Two formats, told apart by the first int32 of the file:

    llm.c    256 int32 header: [20240520, version, token count, 0...], then the tokens
             (version 1: uint16, the GPT-2 vocabulary; version 2: uint32, larger ones)
    nanoGPT  raw tokens, no header; the dtype is a config key (uint16 by default)

A sample is one window: `(x, y)` = (tokens[s : s + block], tokens[s + 1 : s + block + 1])
with s = i x block within one file (windows never cross files, so a document stream
never runs into the next file's). Index i is the same on every rank and run, so the
ElasticSampler's (epoch, cursor) resumes it exactly at any world size.

Nothing is read at construction except the headers and sizes: a token file of tens
of GB costs only its page cache. Each process maps the files itself on first use (a
DataLoader worker or a forked rank never inherits another's maps) and keeps at most
`MAX_OPEN` of them open, as a data set of a thousand small files would otherwise
hold a thousand file descriptors.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.errors import UserError

LLMC_MAGIC = 20240520
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_DTYPES = {1: np.uint16, 2: np.uint32}
"""llm.c header version -> token dtype."""
RAW_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
"""The dtypes a raw (nanoGPT) token file may hold: `data.tokens_dtype`."""
MAX_OPEN = 64
META = "meta.json"
"""The record `disttrain data prepare` keeps in its folder: tokenizer, vocabulary size,
dtype, and every file written."""


@dataclass(frozen=True)
class TokenFile:
    """One token file: where its tokens start, how many, and their dtype."""

    path: Path
    offset: int
    """Bytes before the first token (the llm.c header, or 0)."""
    count: int
    dtype: type
    format: str
    """'llmc' or 'nanogpt'."""


def read_token_file(
    path: str | os.PathLike, raw_dtype: str = "uint16", dtype_key: str = "data.tokens_dtype"
) -> TokenFile:
    """The layout of one token file, from its header and size (no token is read).

    A file that starts with the llm.c magic is llm.c; any other is raw tokens of
    `raw_dtype`. Raises `UserError` naming the file for a header of an unknown
    version, a header whose token count disagrees with the file size, or a raw file
    whose size is not a multiple of the dtype's size; `dtype_key` is what the errors
    call the raw dtype (a config key, or a script's argument).
    """
    path = Path(path)
    if raw_dtype not in RAW_DTYPES:
        raise UserError(f"{dtype_key} is {raw_dtype!r}; choose one of {', '.join(RAW_DTYPES)}.")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(LLMC_HEADER_BYTES)
        head = np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<i4")
    except OSError as e:
        raise UserError(f"token file {path}: cannot read it ({e.strerror or e}).") from None
    if len(head) and int(head[0]) == LLMC_MAGIC:
        if len(head) < LLMC_HEADER_INTS:
            raise UserError(
                f"token file {path}: it starts with the llm.c magic but has {size} bytes, "
                f"less than the {LLMC_HEADER_BYTES}-byte header; it is truncated. Rewrite "
                f"it with `disttrain data prepare`."
            )
        version, count = int(head[1]), int(head[2])
        if version not in LLMC_DTYPES:
            raise UserError(
                f"token file {path}: llm.c header version {version} is unknown (1 = uint16, "
                f"2 = uint32 tokens); rewrite it with `disttrain data prepare`."
            )
        dtype = LLMC_DTYPES[version]
        want = LLMC_HEADER_BYTES + count * np.dtype(dtype).itemsize
        if count < 0 or size != want:
            raise UserError(
                f"token file {path}: its llm.c header says {count} tokens ({want} bytes), "
                f"but the file has {size} bytes; it is truncated or not an llm.c file. "
                f"Rewrite it with `disttrain data prepare`."
            )
        return TokenFile(path, LLMC_HEADER_BYTES, count, dtype, "llmc")
    dtype = RAW_DTYPES[raw_dtype]
    item = np.dtype(dtype).itemsize
    if size % item:
        raise UserError(
            f"token file {path}: {size} bytes is not a whole number of {raw_dtype} tokens "
            f"({item} bytes each), and it has no llm.c header; it is truncated, or set "
            f"{dtype_key} to the dtype it was written with."
        )
    return TokenFile(path, 0, size // item, dtype, "nanogpt")


_VAL_NAME = re.compile(r"(^|[_.-])(val|valid|validation)([_.-]|$)")


def read_meta(folder: Path) -> dict:
    """A prepared folder's meta.json, or {} when there is none (or it is unreadable)."""
    try:
        return json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return {}


def check_vocab(files: list[Path], vocab_size: int | None) -> None:
    """Refuse token files whose prepare record names a vocabulary larger than the
    model's (an out-of-range token would fail deep in the embedding). Files without a
    meta.json are not checked."""
    if vocab_size is None:
        return
    for folder in sorted({p.parent for p in files}):
        need = read_meta(folder).get("vocab_size")
        if isinstance(need, int) and need > vocab_size:
            raise UserError(
                f"token files in {folder} were prepared with a vocabulary of {need} "
                f"({read_meta(folder).get('tokenizer')}), but model.vocab_size is {vocab_size}; "
                f"set model.vocab_size to at least {need}."
            )


def _is_val_name(path: Path) -> bool:
    # nanoGPT writes val.bin; llm.c writes NAME_val_000000.bin.
    return _VAL_NAME.search(path.stem.lower()) is not None


def expand_tokens(spec: str, base: str | os.PathLike | None = None, key: str = "data.tokens") -> list[Path]:
    """The token files a `data.tokens` value names, sorted: a directory (its `*.bin`
    files), a glob, or one file; a relative value is taken from `base`. Raises
    `UserError` naming `key` when it names no file."""
    base_dir = Path(base) if base is not None else Path.cwd()
    full = Path(spec).expanduser()
    full = full if full.is_absolute() else base_dir / full
    if full.is_dir():
        files = sorted(full.glob("*.bin"))
    elif any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(full)) if Path(p).is_file())
    else:
        files = [full] if full.is_file() else []
    if not files:
        what = "has no *.bin file" if full.is_dir() else "matches no file"
        raise UserError(
            f"{key} = {spec!r} {what} (looked at {full}); write token files with "
            f"`disttrain data prepare TEXT_FILES... --out DIR`."
        )
    return files


def split_files(
    files: list[Path], heldout: str, base: str | os.PathLike | None = None
) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files). `heldout` is a glob or path (relative to `base`)
    naming the held-out files; '' picks the files named like a validation split
    (`val.bin`, `NAME_val_000000.bin`). Either list may come back empty: no held-out
    file means the held-out windows are a fraction of the data (`token_datasets`)."""
    if heldout:
        held = expand_tokens(heldout, base)
        return [p for p in files if p not in set(held)], held
    held_files = [p for p in files if _is_val_name(p)]
    return [p for p in files if not _is_val_name(p)], held_files


class TokenWindows(Dataset):
    """A map-style dataset of non-overlapping windows over token files: sample `i` is
    `(x, y)`, two int64 tensors of `block_size` tokens, `y` the next token of each `x`
    (tokens[s : s + block_size] and tokens[s + 1 : s + block_size + 1]).

    `paths`: a folder (its `*.bin` files), a glob, one file, or a list of them, in the
    nanoGPT raw format (tokens of `dtype`: 'uint16', 'uint32' or 'int32', no header) or
    llm.c's (a 256-int32 header that carries its dtype); both may be mixed. Windows
    never cross files, and a file of n tokens holds (n - 1) // block_size of them.
    `split` chooses among the files of a folder or a glob: "train" (the default) leaves
    out those named like a validation split (nanoGPT's `val.bin`, llm.c's
    `NAME_val_000000.bin`), "heldout" keeps only those, "all" keeps every one; a file
    named by itself is always read. `start` / `stop` keep windows [start, stop) of the
    whole sequence (a held-out tail). `block_key` is what the errors call `block_size`
    (`disttrain train` passes its config keys; a script's errors name the arguments).

    The contract that makes resume exact: window `i` is the same tokens on every rank,
    every run and every world size, so `dt.Job.loader` (an `ElasticSampler`) consumes
    each window once per epoch across kills and resizes. Only headers and sizes are read
    at construction; each process memory-maps the files itself on first use (at most
    `MAX_OPEN` open), and a pickled dataset (a DataLoader worker) carries no map.
    Raises `UserError` naming the file for a missing, truncated or malformed file, and
    for a `block_size` below 1; `IndexError` for an index out of range.

        windows = dt.TokenWindows("data/shakespeare", block_size=256)   # train.bin, not val.bin
        held = dt.TokenWindows("data/shakespeare", 256, split="heldout")  # val.bin
        loader = job.loader(dt.TokenWindows("data/train.bin", 256), batch_size=12)
    """

    def __init__(
        self,
        paths,
        block_size: int,
        *,
        dtype: str = "uint16",
        start: int = 0,
        stop: int | None = None,
        split: str = "train",
        block_key: str = "block_size",
    ):
        if not isinstance(block_size, int) or block_size < 1:
            raise UserError(
                f"TokenWindows: {block_key} is {block_size!r}; it must be an integer of "
                f"at least 1 (the tokens per window)."
            )
        if split not in SPLITS:
            raise UserError(f"TokenWindows: split is {split!r}; choose one of {', '.join(map(repr, SPLITS))}.")
        self.files, self.block_size = _token_files(paths, dtype, split), block_size
        # windows per file: a file of n tokens holds (n - 1) // block windows
        self.ends = np.cumsum([max(0, (f.count - 1) // block_size) for f in self.files]).tolist()
        total = self.ends[-1] if self.ends else 0
        self.start, self.stop = start, total if stop is None else min(stop, total)
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pid = os.getpid()

    @property
    def tokens(self) -> int:
        return sum(f.count for f in self.files)

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getstate__(self) -> dict:
        # A pickled memmap would copy its whole file; the receiver maps it again.
        state = dict(self.__dict__)
        state["_maps"] = OrderedDict()
        return state

    def _map(self, k: int) -> np.ndarray:
        if self._pid != os.getpid():  # a forked worker: its own maps
            self._maps, self._pid = OrderedDict(), os.getpid()
        tokens = self._maps.get(k)
        if tokens is None:
            f = self.files[k]
            tokens = np.memmap(f.path, dtype=f.dtype, mode="r", offset=f.offset, shape=(f.count,))
            self._maps[k] = tokens
            if len(self._maps) > MAX_OPEN:
                self._maps.popitem(last=False)
        else:
            self._maps.move_to_end(k)
        return tokens

    def locate(self, i: int) -> tuple[int, int]:
        """(file number, first token) of window i."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} is out of range for {len(self)} windows")
        g = self.start + i
        k = bisect.bisect_right(self.ends, g)
        first = g - (self.ends[k - 1] if k else 0)
        return k, first * self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, s = self.locate(int(i))
        window = torch.from_numpy(self._map(k)[s : s + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


SPLITS = ("train", "heldout", "all")
"""`TokenWindows`' `split`: which files of a folder or glob it reads."""


def _token_files(paths, dtype: str, split: str = "all") -> list[TokenFile]:
    """`TokenWindows`' `paths` as `TokenFile`s: each str or path expanded by `expand_tokens`,
    a folder's or glob's files chosen by `split` (a single file is always kept)."""
    items = [paths] if isinstance(paths, (str, os.PathLike, TokenFile)) else list(paths)
    out: list[TokenFile] = []
    for item in items:
        if isinstance(item, TokenFile):
            out.append(item)
            continue
        found = expand_tokens(os.fspath(item), key="TokenWindows(paths)")
        one_file = Path(os.fspath(item)).expanduser().is_file()  # named by itself: the user chose it
        chosen = found if split == "all" or one_file else _split(found, split)
        if not chosen:
            raise UserError(
                f"TokenWindows(paths={os.fspath(item)!r}, split={split!r}): none of its {len(found)} file(s) is "
                f"a {split} file (val.bin, *_val_*.bin are held out); pass split='all' or name the files."
            )
        out.extend(read_token_file(p, dtype, "TokenWindows(dtype=...)") for p in chosen)
    return out


def _split(files: list[Path], split: str) -> list[Path]:
    train, held = split_files(files, "")
    return train if split == "train" else held


def token_datasets(
    spec: str,
    block_size: int,
    *,
    heldout: str = "",
    heldout_fraction: float = 0.1,
    raw_dtype: str = "uint16",
    base: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    block_key: str = "model.block_size",
) -> tuple[TokenWindows, TokenWindows, dict]:
    """(train windows, held-out windows, summary fields) for `data.tokens`.

    Held-out by file when `heldout` names files or some files are named like a
    validation split; otherwise the last `heldout_fraction` of the windows (at least
    one), so training never sees a held-out window. `vocab_size` (the model's), when
    given, is checked against the folders' meta.json. `block_key` is the config key
    that sets `block_size`, named in the errors. Raises `UserError` for a malformed
    file (naming it), too small a vocabulary, and too little data for one training
    window.
    """
    train_paths, held_paths = split_files(expand_tokens(spec, base), heldout, base)
    check_vocab(train_paths + held_paths, vocab_size)
    if not train_paths:
        raise UserError(
            f"data.tokens = {spec!r}: every file is held out ({', '.join(p.name for p in held_paths)}); "
            f"name the training files in data.tokens, the held-out ones in data.tokens_heldout."
        )
    train_files = [read_token_file(p, raw_dtype) for p in train_paths]
    held_files = [read_token_file(p, raw_dtype) for p in held_paths]
    if held_files:
        train, held = (
            TokenWindows(train_files, block_size, block_key=block_key),
            TokenWindows(held_files, block_size, block_key=block_key),
        )
        split = "file"
    else:
        everything = TokenWindows(train_files, block_size, block_key=block_key)
        cut = len(everything) - max(1, int(len(everything) * heldout_fraction))
        train = TokenWindows(train_files, block_size, stop=cut, block_key=block_key)
        held = TokenWindows(train_files, block_size, start=cut, block_key=block_key)
        split = "fraction"
    if len(train) == 0:
        raise UserError(
            f"data.tokens = {spec!r}: {sum(f.count for f in train_files)} tokens in "
            f"{len(train_files)} file(s) give no training window of block_size + 1 = "
            f"{block_size + 1} tokens (windows do not cross files); lower {block_key} "
            f"or add data."
        )
    summary = {
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "heldout_split": split,
        "train_windows": len(train),
        "train_tokens": len(train) * block_size,
    }
    return train, held, summary
