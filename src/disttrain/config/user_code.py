"""Pure rules for the config keys that name user code: model.factory, data.factory,
train.loss ("module:callable") and their kwargs tables.

Validation only (no import of the named module, no torch): the form of each
reference, factory versus the built-in GPT's shape keys, and kwargs that are plain
data (the config is stored as JSON in every checkpoint). Importing and calling the
code is `disttrain.train.model_data_loss`. Every mistake raises one `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from disttrain.config.gpt_shape import GPTConfig
from disttrain.errors import ConfigError

REFERENCE_KEYS = ("model.factory", "data.factory", "train.loss")
"""Config keys whose value is a 'module:callable' reference."""
GPT_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
"""The built-in GPT's shape keys under [model]; not allowed beside model.factory."""

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_REFERENCE = re.compile(rf"^({_DOTTED}):({_DOTTED})$")


def parse_reference(key: str, value: str) -> tuple[str, str]:
    """'pkg.module:name' -> ('pkg.module', 'name'). Raises `ConfigError` naming `key`."""
    match = _REFERENCE.match(value.strip())
    if not match:
        raise ConfigError(
            f'config key {key!r} is {value!r}; write it as "module:callable", for '
            f'example "mymodels:build" (the module is imported from the config '
            f"file's folder, then sys.path)."
        )
    return match.group(1), match.group(3)


def check_model_keys(model: dict) -> None:
    """The raw [model] table: model.factory (or hf / hf_path) excludes the GPT keys, and
    factory excludes hf / hf_path. Raises `ConfigError` naming both keys."""
    if not model.get("factory"):
        return
    for other in ("hf", "hf_path"):
        if model.get(other):
            raise ConfigError(
                f"config keys 'model.factory' and 'model.{other}' are both set; a "
                f"model comes from one of them. Remove one."
            )
    gpt = [k for k in model if k in GPT_KEYS]
    if gpt:
        raise ConfigError(
            f"config key 'model.factory' ({model['factory']!r}) is set together with "
            f"the built-in GPT's key(s) {', '.join('model.' + k for k in gpt)}; those "
            f"shape only the built-in GPT. Remove them, or pass your model's settings "
            f"in [model.kwargs]."
        )


def check_plain(key: str, value: Any) -> None:
    """Raise `ConfigError` unless `value` is JSON-able plain data (str, int, float, bool,
    list, table): TOML dates and times are refused."""
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(f"{key}.{k}", v)
    elif isinstance(value, list):
        for v in value:
            check_plain(key, v)
    elif not isinstance(value, (str, int, float, bool)):
        raise ConfigError(
            f"config key {key!r} is {value!r} ({type(value).__name__}); kwargs must be "
            f"plain data (string, number, boolean, list, table): the config is stored "
            f"as JSON in every checkpoint. Pass it as a string."
        )


def check_sources(cfg: Any) -> None:
    """Validate the user-code keys of a whole `Config` (pure; no import of user code)."""
    m = cfg.model
    refs = {"model.factory": m.factory, "data.factory": cfg.data.factory, "train.loss": cfg.train.loss}
    for key, value in refs.items():
        if value:
            parse_reference(key, value)
    if m.factory:
        defaults = GPTConfig()
        changed = [k for k in GPT_KEYS if getattr(m, k) != getattr(defaults, k)]
        if changed or m.hf or m.hf_path:
            check_model_keys(
                {"factory": m.factory, "hf": m.hf, "hf_path": m.hf_path, **{k: getattr(m, k) for k in changed}}
            )
    for key, value in (("model.kwargs", m.kwargs), ("data.kwargs", cfg.data.kwargs), ("model.hf_config", m.hf_config)):
        check_plain(key, value)
    if (m.kwargs and not m.factory) or (cfg.data.kwargs and not cfg.data.factory):
        key = "model" if m.kwargs and not m.factory else "data"
        raise ConfigError(
            f"config key '{key}.kwargs' is set but '{key}.factory' is not; kwargs are "
            f'passed to the factory. Set {key}.factory = "module:callable".'
        )
