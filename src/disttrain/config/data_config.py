"""The `[data]` section: where the training data comes from (the stdlib corpus, user
code, token files, a Hugging Face datasets folder) and how it is loaded (docs/data.md).

Kept out of schema.py so that file stays one page; schema.py makes it a `Config` section
and calls `check_data_source`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"config key {key!r} is {value!r}; choose one of {', '.join(allowed)}.")


@dataclass(kw_only=True)
class DataConfig:
    """[data]: where `disttrain train`'s training data comes from (the stdlib corpus, a
    factory of your own, token files or a Hugging Face datasets folder) and how it loads."""

    factory: str = ""
    """'module:callable' returning a map-style train dataset, or (train, eval); '' = the corpus."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for data.factory (plain TOML data)."""
    corpus: str = "stdlib"
    """'stdlib': the bytes of the Python standard library's own .py files, read at run time."""
    max_bytes: int = 4_000_000
    """Cap on training bytes read from the corpus (held-out files are read in addition)."""
    heldout_fraction: float = 0.1
    """Fraction of files, chosen by a hash of their path, kept out of training (data.tokens
    without held-out files: the last fraction of the windows)."""
    drop_last: bool = False
    """False pads the last global batch by repeating samples (DistributedSampler default)."""
    tokens: str = ""
    """Token files (nanoGPT raw .bin, llm.c shards): a folder of *.bin, a glob, or a file,
    relative to the config file's folder (docs/data.md). '' = the corpus."""
    tokens_heldout: str = ""
    """Held-out token files (a glob or path); '' = the files named like val.bin / *_val_*.bin,
    else the last data.heldout_fraction of the windows."""
    block_size: int = 0
    """Tokens per sample of data.tokens (and the longest row of data.hf_dataset); 0 =
    model.block_size (the built-in GPT's, or a model.hf model's window). Needed beside
    model.factory with data.tokens: the window length is the data's there."""
    tokens_dtype: str = "uint16"
    """The dtype of raw (headerless, nanoGPT) token files: uint16, uint32 or int32; llm.c
    files carry theirs in the header."""
    hf_dataset: str = ""
    """A Hugging Face `datasets` folder written by save_to_disk (load_from_disk), relative
    to the config file's folder. Needs disttrain[data]."""
    hf_columns: list[str] = field(default_factory=lambda: ["input_ids"])
    """The columns a sample is made of: one column of block_size + 1 token ids gives (x, y)
    next-token pairs; several give a dict {column: tensor} for model(**batch)."""
    hf_split: str = "train"
    """The split to train on when the folder holds a DatasetDict."""
    hf_heldout_split: str = "validation"
    """The held-out split of a DatasetDict; missing or '' means no held-out set."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process). Resume stays
    exact: the sampler, not the workers, decides the order."""
    pin_memory: bool = False
    """DataLoader: page-locked host batches (faster copies to a GPU)."""
    persistent_workers: bool = False
    """DataLoader: keep the workers between epochs (needs data.num_workers > 0)."""


TOKEN_DTYPES = ("uint16", "uint32", "int32")


def check_data_source(d: DataConfig, model_key: str = "") -> None:
    """At most one of data.factory, data.tokens, data.hf_dataset; known dtype; columns;
    the window length: data.block_size with data.tokens beside `model_key` ('model.factory',
    whose model has no model.block_size; '' otherwise). Raises `ConfigError` naming the
    keys in use."""
    _require(
        d.block_size >= 0,
        f"config key 'data.block_size' is {d.block_size}; use the tokens per "
        f"sample (at least 1), or 0 for the built-in GPT's model.block_size.",
    )
    _require(
        not (d.tokens and model_key and d.block_size == 0),
        f"config keys 'data.tokens' and {model_key!r} are set but 'data.block_size' is not: the "
        f"tokens per sample come from the data beside a model of your own. Set data.block_size "
        f"= N (your model's context length).",
    )
    chosen = [k for k in ("factory", "tokens", "hf_dataset") if getattr(d, k)]
    _require(
        len(chosen) <= 1,
        f"config keys {', '.join('data.' + k for k in chosen)} are all set; the "
        f"training data comes from one of them. Remove the others.",
    )
    _one_of("data.tokens_dtype", d.tokens_dtype, TOKEN_DTYPES)
    _require(
        not d.hf_dataset or (bool(d.hf_columns) and all(isinstance(c, str) and c for c in d.hf_columns)),
        f'data.hf_columns is {d.hf_columns!r}; name the column(s) a sample is made of, for example ["input_ids"].',
    )
