"""TOML files and dotted CLI overrides into typed, kw_only dataclasses.

Generic: knows nothing of disttrain's sections. Every mistake raises `ConfigError`
naming the file or the dotted key and the fix (an unknown key suggests the nearest
valid one).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from disttrain import json_text
from disttrain.errors import ConfigError


def read_toml(path: str | os.PathLike) -> dict:
    """The parsed file. Raises `ConfigError` for a missing file or bad TOML."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"config file {p} is a directory; pass the path of a TOML file inside it, "
            f"for example examples/tiny_gpt.toml."
        )
    if not p.is_file():
        raise ConfigError(
            f"config file not found: {p}. Pass the path of a TOML file, for example examples/tiny_gpt.toml."
        )
    try:
        return _parsed(p.read_bytes().decode("utf-8"), str(p))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); TOML "
            f"files are UTF-8: save it in that encoding."
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p} is not valid TOML: {e}. Fix the syntax at that line.") from None


def _parsed(text: str, what: str) -> dict:
    """The TOML document `text` (`what` names it), nested at most `json_text.MAX_DEPTH`
    deep. Raises `tomllib.TOMLDecodeError` for bad TOML, `ConfigError` for a document
    nested deeper (tomllib recurses once per level, and so would every later walk)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except ValueError as e:  # a number of thousands of digits (a TOMLDecodeError is one too)
        raise ConfigError(f"{what} holds a value TOML cannot read: {str(e)[:120]}.") from None
    except RecursionError:
        doc = None
    try:
        json_text.check_depth(doc)
    except ValueError:
        doc = None
    if doc is None:
        raise ConfigError(
            f"{what} nests arrays or tables more than {json_text.MAX_DEPTH} levels deep; a config needs a few."
        )
    return doc


def apply_overrides(raw: dict, overrides: Sequence[str], convert: Callable[[str, Any], Any] | None = None) -> dict:
    """Set each `--section.key=value` in `raw` (in place, and returned); `convert(key,
    value)`, when given, maps each parsed value before it is set."""
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, convert(key, value) if convert is not None else value)
    return raw


def build(cls: type, raw: Any) -> Any:
    """`cls(**raw)`, recursively, with types checked against the dataclass fields."""
    return _build(cls, raw, prefix="")


def _parse_override(item: str) -> tuple[str, Any]:
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(
            f"override {item!r} has no value. Write it as --section.key=value, for example --train.steps=100."
        )
    key, value = text.split("=", 1)
    try:  # A TOML literal (number, bool, list, quoted string) keeps its type.
        return key.strip(), _parsed(f"v = {value}", f"override {item[:80]!r}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value  # a bare word is a string


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override --{key}: {part!r} is a value, not a section.")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table (section), got {type(raw).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{prefix}{key}'.{hint} Valid keys in [{where}]: {', '.join(fields)}."
            )
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
            try:
                return _coerce(arm, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key!r} has a value of the wrong type: {value!r}.")
    if origin is dict:
        return _mapping(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}.")
        return [_coerce(item_tp, v, key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (
        tp is bool
        and not isinstance(value, bool)
        or tp is not bool
        and isinstance(value, bool)
        or not isinstance(value, tp)
    ):
        raise ConfigError(
            f"config key {key!r} must be {tp.__name__}, got {value!r} "
            f"({type(value).__name__}). Example: --{key}={_example(tp)}."
        )
    return value


def _mapping(tp: Any, value: Any, key: str) -> dict:
    """A `dict[str, V]` key: a TOML table (an inline one, `{"a.*" = "x"}`, in an override)
    whose every value is a V."""
    _, value_tp = typing.get_args(tp)
    if not isinstance(value, dict):
        raise ConfigError(f'config key {key!r} must be a table, got {value!r}. Example: --{key}={{"name" = "value"}}.')
    for name, item in value.items():
        if not isinstance(item, value_tp) or isinstance(item, bool) and value_tp is not bool:
            raise ConfigError(
                f"config key {key!r} maps {name!r} to {item!r} ({type(item).__name__}); "
                f"each value must be {value_tp.__name__}."
            )
    return dict(value)


def _example(tp: type) -> str:
    return {int: "4", float: "0.5", bool: "true", str: '"text"'}.get(tp, "...")
