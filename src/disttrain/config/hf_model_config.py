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

from disttrain.errors import UserError

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
            f"model.hf_path {hf_path!r}: no folder {p} (a relative path is taken "
            f"from the config file's folder). Point it at a save_pretrained folder."
        )
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.hf_path {hf_path!r}: {p} has no config.json, so it is not a "
            f'save_pretrained folder. Use model.hf = "<model type>" to build from a config.'
        )
    return p


def hf_config_from_section(section: Any, config_dir: str | os.PathLike | None = None):
    """The `transformers` config that a model section describes: `hf` (a model type such
    as "gpt2") with `hf_config` overrides, or `hf_path` (a local save_pretrained folder,
    overrides applied on top). `section` is the config dataclass or its dict form.
    Raises `UserError` for a missing `transformers`, an unknown model type, a bad
    override key type, or a folder without a config. Never downloads anything."""
    transformers = import_transformers()
    hf, hf_path = _get(section, "hf") or "", _get(section, "hf_path") or ""
    overrides = dict(_get(section, "hf_config") or {})
    if hf and hf_path:
        raise UserError(
            "model.hf and model.hf_path are both set; use one: hf builds from a "
            "config, hf_path loads a local save_pretrained folder."
        )
    if hf_path:
        folder = resolve_hf_path(hf_path, config_dir)
        try:
            return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, **overrides)
        except (OSError, ValueError) as e:
            raise UserError(
                f"model.hf_path {hf_path!r}: {folder}/config.json cannot be read "
                f"by transformers: {str(e).splitlines()[0]}"
            ) from e
    if not hf:
        raise UserError("the model section names no Hugging Face model (model.hf or model.hf_path).")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if hf not in known:
        close = difflib.get_close_matches(hf, known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UserError(
            f"model.hf is {hf!r}, which is not a transformers model type "
            f"(transformers {transformers.__version__}).{hint} Use a model type "
            f"such as 'gpt2' or 'llama', not a hub name."
        )
    try:
        return transformers.AutoConfig.for_model(hf, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"model.hf_config for {hf!r} is invalid: {str(e).splitlines()[0]}") from e


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
