"""The value rules of the config, as one table: ranges, finiteness and cross-key rules,
checked by `validate` in the launching process, so that no value a worker cannot use
ever reaches one (types are `tomlfile`'s, before this).

Three parts, each applied to every key it covers:

- every float, and every float in a list, must be finite (nan and inf are refused
  wherever they appear, whatever key a later version adds);
- no string may contain a NUL character (no path or name can hold one);
- `RANGES`: per key, the values it accepts, said in words for the message;
- `CROSS`: rules between keys (the model's shape against the data it reads, ...).

Each refusal is one `ConfigError` line: the key, its value, what it must be.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from disttrain.errors import ConfigError

BYTE_VOCAB = 256
"""The byte corpus has 256 symbols: the built-in GPT reading it needs a vocab this large."""
MAX_TIMEOUT_S = 30 * 86400.0
"""Longest timeout or period a key may name: torch turns seconds into a `timedelta`."""


def _between(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False, whole: bool = False
) -> tuple[Callable[[Any], bool], str]:
    def test(v: Any) -> bool:
        return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)

    kind = "a whole number" if whole else "a number"
    if math.isinf(high):
        return test, f"{kind} {'>' if low_open else '>='} {low:g}"
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    return test, f"{kind} in {left}{low:g}, {high:g}{right}"


def _at_least(low: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f"at least {low}"


def _positive(high: float = math.inf) -> tuple[Callable[[Any], bool], str]:
    if math.isinf(high):
        return (lambda v: v > 0), "a positive number"
    return (lambda v: 0 < v <= high), f"a positive number of at most {high:g}"


def _non_empty() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: bool(v.strip())), "a non-empty path (an empty one means the current directory)"


def _betas() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)), "two numbers in [0, 1), e.g. [0.9, 0.95]"


RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.vocab_size": _at_least(1),
    "model.block_size": _at_least(1),
    "model.n_layer": _at_least(1),
    "model.n_head": _at_least(1),
    "model.n_embd": _at_least(1),
    "model.dropout": _between(0, 1, high_open=True),
    "data.max_bytes": _at_least(1),
    "data.heldout_fraction": _between(0, 1, low_open=True, high_open=True),
    "data.num_workers": _between(0, 64, whole=True),
    "parallel.nproc": _at_least(1),
    "parallel.timeout_s": _positive(MAX_TIMEOUT_S),
    "parallel.bucket_cap_mb": _positive(65536),
    "parallel.shard_group_size": _at_least(0),
    "parallel.tp": _at_least(1),
    "optim.lr": _positive(),
    "optim.weight_decay": _between(0, math.inf),
    "optim.momentum": _between(0, 1, high_open=True),
    "optim.betas": _betas(),
    "optim.grad_clip": _between(0, math.inf),
    "optim.warmup_steps": _at_least(-1),
    "optim.min_lr_ratio": _between(0, 1),
    "train.steps": _at_least(1),
    "train.batch_size": _at_least(1),
    "train.accum_steps": _at_least(1),
    "train.seed": _between(0, 2**32 - 1, whole=True),
    "train.log_every": _at_least(1),
    "train.eval_every": _at_least(0),
    "train.eval_batches": _at_least(1),
    "train.out_dir": _non_empty(),
    "guard.divergence_every": _at_least(0),
    "guard.hang_factor": _between(1, math.inf, low_open=True),
    "guard.hang_min_s": _positive(MAX_TIMEOUT_S),
    "guard.hang_cap_s": _positive(MAX_TIMEOUT_S),
    "guard.tick_s": _positive(3600),
    "checkpoint.every": _at_least(0),
    "checkpoint.every_s": _between(0, MAX_TIMEOUT_S),
    "checkpoint.keep_last": _at_least(0),
    "elastic.preempt_grace_s": _positive(86400),
    "elastic.buddy_every": _at_least(1),
}


def _builtin_gpt(cfg: Any) -> bool:
    m = cfg.model
    return not (m.factory or m.hf or m.hf_path)


def _byte_corpus(cfg: Any) -> bool:
    d = cfg.data
    return not any(getattr(d, k, "") for k in ("factory", "tokens", "hf_dataset"))


def _cross(cfg: Any) -> list[str]:
    """The messages of every cross-key rule that `cfg` breaks (usually none)."""
    m, d, g = cfg.model, cfg.data, cfg.guard
    out = []
    if m.n_embd % m.n_head:
        out.append(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}).")
    if _builtin_gpt(cfg) and _byte_corpus(cfg) and m.vocab_size < BYTE_VOCAB:
        out.append(
            f"model.vocab_size is {m.vocab_size}, but the byte corpus has {BYTE_VOCAB} symbols; "
            f"use model.vocab_size >= {BYTE_VOCAB}."
        )
    if _byte_corpus(cfg) and _builtin_gpt(cfg) and d.max_bytes < m.block_size + 1:
        out.append(
            f"data.max_bytes is {d.max_bytes}, less than one training window of model.block_size "
            f"+ 1 = {m.block_size + 1} bytes; raise data.max_bytes or lower model.block_size."
        )
    if g.hang_cap_s < g.hang_min_s:
        out.append(f"guard.hang_cap_s ({g.hang_cap_s:g}) must be >= guard.hang_min_s ({g.hang_min_s:g}).")
    return out


def _leaves(obj: Any, prefix: str = ""):
    """(dotted key, value) of every field of a config dataclass, recursively."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _plain(value: Any):
    """Every number and string inside `value` (kwargs tables and lists included)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _plain(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _plain(v)
    else:
        yield value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_values(cfg: Any) -> None:
    """Apply the table to a built `Config`. Raises `ConfigError` (one line) for the first
    key that breaks a rule: the key, its value, and what it must be."""
    values = dict(_leaves(cfg))
    for key, value in values.items():
        for v in _plain(value):
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(
                    f"config key {key!r} is {_show(value)}; it must be a finite number (nan and inf are refused)."
                )
            if isinstance(v, str) and "\x00" in v:
                raise ConfigError(f"config key {key!r} contains a NUL character; remove it.")
    for key, (test, says) in RANGES.items():
        if key in values and not test(values[key]):
            raise ConfigError(f"config key {key!r} is {_show(values[key])}; it must be {says}.")
    for message in _cross(cfg):
        raise ConfigError(message)
