"""What a model section says about a Hugging Face model, shared by the trainer
(train/hf_models.py builds it) and the export (checkpoint/hf_export.py rebuilds it):
the `transformers` config a section names (`hf` + `hf_config`, or `hf_path`), the
empty causal LM that config describes, the section that describes a given model
(`hf_section`, which a `dt.Job` stores in its checkpoints), and the prefix `HF_PREFIX`
under which the `HFCausalLM` adapter registers the model. Here, in the config layer,
because `checkpoint/` may not import `train/`. Imports `transformers` only when asked.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

from disttrain import json_text
from disttrain.errors import UserError
from disttrain.plain_files import NotPlainFile, read_plain

HF_PREFIX = "hf."
"""State-dict prefix of the Hugging Face model inside the `HFCausalLM` adapter."""


def _get(section: Any, key: str, default=None):
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)


def import_transformers():
    """`transformers`, or a `UserError` saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise UserError(
            "model.hf / model.hf_path need the `transformers` package, which is not installed: pip install transformers"
        ) from e
    return transformers


def resolve_hf_path(hf_path: str, config_dir: str | os.PathLike | None) -> Path:
    """`model.hf_path` as a folder: relative paths are relative to `config_dir` (the
    config file's folder), else to the current directory. Raises `UserError` when the
    folder or its `config.json` is missing."""
    p = Path(hf_path).expanduser()
    if not p.is_absolute() and config_dir is not None:
        p = Path(config_dir) / p
    if not p.is_dir():
        raise UserError(
            f"model.hf_path {hf_path!r}: no folder {p} (a relative path in a TOML "
            f"file is taken from that file's folder). Point it at a save_pretrained folder."
        )
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.hf_path {hf_path!r}: {p} has no config.json, so it is not a "
            f'save_pretrained folder. Use model.hf = "<model type>" to build from a config.'
        )
    return p


LOADER_KEYS = frozenset(
    {
        # Each chooses code to import or how transformers loads, not what the model is.
        "trust_remote_code",
        "auto_map",
        "attn_implementation",
        "custom_pipelines",
        "name_or_path",
        "quantization_config",
        "cache_dir",
        "code_revision",
        "force_download",
        "local_files_only",
        "proxies",
        "revision",
        "subfolder",
        "token",
    }
)
"""Keys a model section's `hf_config` (and a `hf_path` folder's config.json) may not
hold; so may no key that starts with `_` (transformers' internal fields)."""

_CONFIG_JSON_LIMIT = 4 << 20  # a config.json is a few KiB; a bigger one is not one


def _plain(value, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth >= 8:
        return False
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def plain_config_values(values: Any, where: str) -> dict:
    """`values` (an `hf_config` table or a config.json) as keyword values for a config
    class: a dict of JSON scalars, lists and tables only, none of whose keys is in
    `LOADER_KEYS` or starts with `_`. Raises `UserError` naming `where` (the file or
    key the values came from) and the first offending key; returns a copy."""
    if not isinstance(values, dict):
        raise UserError(f"{where}: expected a table of config values, got {type(values).__name__}.")
    for key, value in values.items():
        if not isinstance(key, str) or key in LOADER_KEYS or key.startswith("_"):
            raise UserError(
                f"{where}: {key!r} chooses code or how transformers loads a model, not a "
                f"config value; disttrain never passes it on: remove it."
            )
        if not _plain(value):
            raise UserError(f"{where}: {key!r} is not a plain value (JSON numbers, strings, lists and tables).")
    return dict(values)


def read_config_json(folder: Path, where: str, *, follow: bool = True) -> tuple[str, dict]:
    """The model type and the plain values of `folder/config.json`, read as JSON (never
    by transformers' loader, which may import code the folder names), opened once by
    `plain_files.read_plain`: a regular file of at most `_CONFIG_JSON_LIMIT` bytes, a
    FIFO refused without waiting, a symlink followed only with `follow` (a user's own
    folder; a Hugging Face cache links its files). `where` says who named the folder.
    Raises `UserError` for an unreadable, oversized, irregular or malformed file, one
    without a `model_type`, or one with a key `plain_config_values` refuses."""
    path = folder.absolute() / "config.json"
    try:
        values = json_text.loads(read_plain(path, _CONFIG_JSON_LIMIT, follow=follow))
    except (OSError, ValueError, NotPlainFile) as e:
        raise UserError(f"{path} ({where}) cannot be read as a config.json: {str(e).splitlines()[0]}") from e
    values = plain_config_values(
        {k: v for k, v in values.items() if k != "transformers_version"} if isinstance(values, dict) else values,
        f"{path} ({where})",
    )
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{path} ({where}) has no model_type; it is not a save_pretrained config.json.")
    return model_type, values


def config_for_type(model_type: str, values: dict, where: str):
    """`AutoConfig.for_model(model_type, **values)` for a model type transformers ships
    (so no code of a folder's choosing); `values` must come from `plain_config_values`.
    Raises `UserError` naming `where` for an unknown type (with close matches) or a
    value the config class rejects."""
    transformers = import_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UserError(
            f"{where} is {model_type!r}, which is not a transformers model type "
            f"(transformers {transformers.__version__}).{hint} Use a model type "
            f"such as 'gpt2' or 'llama', not a hub name."
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # a config class validates as its release does (TypeError, hub's strict errors)
        raise UserError(f"{where}: the config values for {model_type!r} are invalid: {str(e).splitlines()[0]}") from e


def _inside(folder: Path, root: Path, hf_path: str, at: str) -> None:
    """Raise `UserError` unless `folder`, its links resolved, lies inside `root`."""
    if not folder.resolve().is_relative_to(root.resolve()):
        raise UserError(
            f"{at}model.hf_path {hf_path!r} lies outside the checkpoint's folder {root}; disttrain reads "
            f"nothing outside it: copy that save_pretrained folder into {root} and point model.hf_path there."
        )


def hf_config_from_section(
    section: Any, config_dir: str | os.PathLike | None = None, stored_in: str = "", inside: Path | None = None
):
    """The `transformers` config that a model section describes: `hf` (a model type such
    as "gpt2") with `hf_config` overrides, or `hf_path` (a local save_pretrained folder,
    whose config.json is read as data, overrides applied on top). `section` is the
    config dataclass or its dict form; `stored_in` names the file it was read from (a
    checkpoint's state.json) for messages; `inside` (its checkpoint folder) is where
    an `hf_path` it names must lie, links resolved, and no link is followed to its
    config.json. Whatever the section says, the config is a
    class transformers ships built from plain values: no code is imported, nothing is
    downloaded, and `trust_remote_code` or an `auto_map` (`LOADER_KEYS`) is refused.
    Raises `UserError` for a missing `transformers`, an unknown model type, a refused
    or malformed value, or a folder without a config."""
    import_transformers()
    at = f"{stored_in}: " if stored_in else ""
    hf, hf_path = _get(section, "hf") or "", _get(section, "hf_path") or ""
    overrides = plain_config_values(_get(section, "hf_config") or {}, f"{at}model.hf_config")
    if hf and hf_path:
        raise UserError(
            f"{at}model.hf and model.hf_path are both set; use one: hf builds from a "
            "config, hf_path loads a local save_pretrained folder."
        )
    if hf_path:
        folder = resolve_hf_path(hf_path, config_dir)
        if inside is not None:
            _inside(folder, inside, hf_path, at)
        model_type, values = read_config_json(folder, f"{at}model.hf_path {hf_path!r}", follow=inside is None)
        return config_for_type(model_type, {**values, **overrides}, f"{folder}/config.json's model_type")
    if not hf:
        raise UserError(f"{at}the model section names no Hugging Face model (model.hf or model.hf_path).")
    return config_for_type(hf, overrides, f"{at}model.hf")


def hf_section(model: Any) -> dict | None:
    """The model section that describes a Hugging Face model given to `dt.Job`:
    {"hf": its model type, "hf_config": its config's values that differ from the type's
    defaults}, stored in the Job's checkpoints so that `ckpt export --hf` rebuilds it;
    None for a module that is not a transformers `PreTrainedModel`. Imports nothing."""
    config: Any = getattr(model, "config", None)
    if not (hasattr(config, "to_json_string") and getattr(config, "model_type", None)):
        return None
    values = json.loads(config.to_json_string(use_diff=True))
    for key in ("model_type", "transformers_version"):  # the type is "hf"; the version, no setting
        values.pop(key, None)
    return {"hf": config.model_type, "hf_config": values}


def causal_lm_from_config(hf_config, where: str):
    """`AutoModelForCausalLM.from_config`, with a `UserError` when the model type has no
    causal-LM head (`where` names the config key for the message)."""
    transformers = import_transformers()
    try:
        return transformers.AutoModelForCausalLM.from_config(hf_config)
    except ValueError as e:
        raise UserError(
            f"{where}: model type {hf_config.model_type!r} has no causal language "
            f"model class in transformers (AutoModelForCausalLM); disttrain trains "
            f"causal LMs such as gpt2 or llama."
        ) from e
