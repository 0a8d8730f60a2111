"""Where `disttrain train` gets its model, data and loss: the built-in GPT on the stdlib
corpus (the defaults), or the user's own code named in the config.

    [model]  factory = "mymodels:build"   [model.kwargs] ...   -> an nn.Module
    [data]   factory = "mydata:build"     [data.kwargs] ...    -> a map-style train dataset,
                                                                  or (train, eval)
    [train]  loss = "mylosses:fn"                              -> fn(model, batch) -> loss

A "module:callable" reference is imported from the config file's folder, then
sys.path. Every user mistake is one `ConfigError` naming the key and the module:
`check_references` (the launching process, before any worker starts) covers import
failures and non-callables; `build_model` / `build_datasets` the returned types. What
the loop does with a batch of them (the device, the forward, the loss) is
`train/batches.py`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disttrain.config import Config
from disttrain.config.user_code import parse_reference
from disttrain.errors import ConfigError

HF_MODULE = "disttrain.train.hf_models"
"""The Hugging Face model builder, imported only when model.hf or model.hf_path is set."""


def resolve(key: str, reference: str, config_dir: str | Path | None) -> Callable:
    """The callable a 'module:callable' config value names. `config_dir` goes first on
    sys.path. Raises `ConfigError` naming `key` and the module when the import fails or
    the name is missing or not callable."""
    module_name, attr = parse_reference(key, reference)
    if config_dir is not None and str(Path(config_dir).resolve()) not in sys.path:
        sys.path.insert(0, str(Path(config_dir).resolve()))
    where = (
        f"the config file's folder ({Path(config_dir).name or '.'}), then sys.path"
        if config_dir is not None
        else "sys.path"
    )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an error inside the user's module is the user's too
        raise ConfigError(
            f"config key {key!r} = {reference!r}: cannot import module {module_name!r} "
            f"(searched {where}): {type(e).__name__}: {e}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"config key {key!r} = {reference!r}: module {module_name!r} has no attribute {attr!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(
            f"config key {key!r} = {reference!r}: {attr!r} in module {module_name!r} is "
            f"a {type(target).__name__}, not callable. Name a function or class."
        )
    return target


def check_references(cfg: Config, config_dir: str | Path | None) -> None:
    """Import every user-code reference of `cfg` once (the launching process calls this
    before starting workers). Raises `ConfigError` as `resolve` does."""
    for key, value in (
        ("model.factory", cfg.model.factory),
        ("data.factory", cfg.data.factory),
        ("train.loss", cfg.train.loss),
    ):
        if value:
            resolve(key, value, config_dir)


def uses_builtin_model(cfg: Config) -> bool:
    """True for the built-in GPT (no model.factory, model.hf or model.hf_path)."""
    m = cfg.model
    return not (m.factory or m.hf or m.hf_path)


def build_model(cfg: Config, config_dir: str | Path | None) -> torch.nn.Module:
    """The unwrapped model: the built-in GPT, the Hugging Face model (model.hf / hf_path),
    or model.factory(**model.kwargs). Call it after the init seed is set (every rank
    builds the same initial weights). Raises `ConfigError` when the factory's result is
    not an nn.Module, or when the factory raises."""
    m = cfg.model
    # ---- hook: Hugging Face models (disttrain.train.hf_models, imported lazily) ----
    if m.hf or m.hf_path:
        return importlib.import_module(HF_MODULE).build_hf_model(m)  # hf_path: as load_config made it
    if not m.factory:
        from disttrain.builtin import GPT

        return GPT(m)
    factory = resolve("model.factory", m.factory, config_dir)
    model = _call("model.factory", m.factory, factory, m.kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"config key 'model.factory' = {m.factory!r} returned a "
            f"{type(model).__name__}; it must return a torch.nn.Module."
        )
    return model


def build_datasets(cfg: Config, config_dir: str | Path | None) -> tuple[Any, Any | None, dict]:
    """(train set, eval set or None, extra summary fields). The default is the stdlib
    corpus cut into block_size chunks of (x, y); data.factory(**data.kwargs) may return
    a map-style dataset (`__len__` and `__getitem__`) or a (train, eval) pair of them.
    `config_dir` is where data.factory's module is looked up first; data.tokens and
    data.hf_dataset are read as the config holds them (config/path_keys.py). Raises
    `ConfigError` for any other return value or an empty train set."""
    d = cfg.data
    # ---- hook: token files and Hugging Face datasets on disk (disttrain.data, lazily) ----
    if d.tokens or d.hf_dataset:
        return _disk_datasets(cfg)
    if not d.factory:
        from disttrain.builtin.corpus import ChunkDataset, load_stdlib_corpus

        corpus = load_stdlib_corpus(d.max_bytes, d.heldout_fraction)
        return (
            ChunkDataset(corpus.train, cfg.model.block_size),
            ChunkDataset(corpus.heldout, cfg.model.block_size),
            {"train_files": corpus.files_train, "heldout_files": corpus.files_heldout},
        )
    factory = resolve("data.factory", d.factory, config_dir)
    result = _call("data.factory", d.factory, factory, d.kwargs)
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    train, heldout = result if pair else (result, None)
    for role, ds in (("train", train), ("eval", heldout)):
        if ds is None and role == "eval":
            continue
        if isinstance(ds, torch.utils.data.IterableDataset) or not (
            hasattr(ds, "__len__") and hasattr(ds, "__getitem__")
        ):
            shape = "a (train, eval) pair whose " + role + " item is" if pair else "returned"
            raise ConfigError(
                f"config key 'data.factory' = {d.factory!r} {shape} a "
                f"{type(ds).__name__}; it must return a map-style dataset (with "
                f"__len__ and __getitem__), or a (train, eval) pair of them. "
                f"Iterable datasets cannot be resumed sample-exactly."
            )
    if len(train) == 0:
        raise ConfigError(f"config key 'data.factory' = {d.factory!r} returned an empty train set.")
    return train, heldout, {}


def _disk_datasets(cfg: Config) -> tuple[Any, Any | None, dict]:
    """data.tokens (disttrain.data.token_files) or data.hf_dataset (disttrain.data.hf_data)
    as the config holds them: `load_config` made a file's relative paths absolute, and a
    relative path left is the current folder's (config/path_keys.py). The built-in GPT's
    block_size and vocab_size bound the windows and the token files' vocabulary."""
    d, builtin = cfg.data, uses_builtin_model(cfg)
    if d.tokens:
        from disttrain.data.token_files import token_datasets

        return token_datasets(
            d.tokens,
            window(cfg),
            heldout=d.tokens_heldout,
            heldout_fraction=d.heldout_fraction,
            raw_dtype=d.tokens_dtype,
            vocab_size=cfg.model.vocab_size if builtin else None,
            block_key="data.block_size" if d.block_size else "model.block_size",
        )
    from disttrain.data.hf_data import hf_datasets

    return hf_datasets(
        d.hf_dataset,
        d.hf_columns,
        split=d.hf_split,
        heldout_split=d.hf_heldout_split,
        block_size=window(cfg) if builtin or d.block_size else None,
    )


def window(cfg: Config) -> int:
    """Tokens per sample of data.tokens / data.hf_dataset: data.block_size, else the
    built-in GPT's model.block_size (validation requires the first beside a model of
    the user's)."""
    return cfg.data.block_size or cfg.model.block_size


def data_key(cfg: Config) -> str:
    """The [data] key the training samples come from, for messages."""
    d = cfg.data
    return next((f"data.{k}" for k in ("factory", "tokens", "hf_dataset") if getattr(d, k)), "data.corpus")


def build_loss(cfg: Config, config_dir: str | Path | None) -> Callable | None:
    """train.loss resolved to fn(model, batch) -> scalar loss, or None (the output's loss)."""
    return resolve("train.loss", cfg.train.loss, config_dir) if cfg.train.loss else None


def _call(key: str, reference: str, factory: Callable, kwargs: dict) -> Any:
    try:
        return factory(**kwargs)
    except Exception as e:
        raise ConfigError(
            f"config key {key!r} = {reference!r} raised {type(e).__name__}: {e} (called with kwargs {kwargs})."
        ) from e
