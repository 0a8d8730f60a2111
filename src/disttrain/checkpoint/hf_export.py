"""`disttrain ckpt export DIR --hf OUTDIR`: a checkpoint as a Hugging Face model folder.

The model's Hugging Face config comes from the checkpoint's own resolved config
(`state.json` -> `config.model`: `hf` + `hf_config`, or `hf_path`; a `dt.Job` stores
the section of a Hugging Face model it wrapped, `hf_section`). The model is built
empty on the meta device, each weight is read from the DCP checkpoint (gathered from
its shards, one tensor at a time) and put in place, and `save_pretrained` writes
safetensors plus `config.json`. `AutoModelForCausalLM.from_pretrained(OUTDIR)` then
gives the trained model's logits exactly. No process group is needed.

This module also owns the two facts that the trainer's side
(`disttrain.train.hf_models`) shares with the export, because `checkpoint/` may not
import `train/`: how a model section names its Hugging Face config
(`hf_config_from_section`) and the prefix `HF_PREFIX` under which the `HFCausalLM`
adapter registers the Hugging Face model.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import shutil
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
        raise UserError("model.hf / model.hf_path need the `transformers` package, which is not "
                        "installed: pip install transformers") from e
    return transformers


def resolve_hf_path(hf_path: str, config_dir: str | os.PathLike | None) -> Path:
    """`model.hf_path` as a folder: relative paths are relative to `config_dir` (the
    config file's folder), else to the current directory. Raises `UserError` when the
    folder or its `config.json` is missing."""
    p = Path(hf_path).expanduser()
    if not p.is_absolute() and config_dir is not None:
        p = Path(config_dir) / p
    if not p.is_dir():
        raise UserError(f"model.hf_path {hf_path!r}: no folder {p} (a relative path is taken "
                        f"from the config file's folder). Point it at a save_pretrained folder.")
    if not (p / "config.json").is_file():
        raise UserError(f"model.hf_path {hf_path!r}: {p} has no config.json, so it is not a "
                        f"save_pretrained folder. Use model.hf = \"<model type>\" to build from a config.")
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
        raise UserError("model.hf and model.hf_path are both set; use one: hf builds from a "
                        "config, hf_path loads a local save_pretrained folder.")
    if hf_path:
        folder = resolve_hf_path(hf_path, config_dir)
        try:
            return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                           **overrides)
        except (OSError, ValueError) as e:
            raise UserError(f"model.hf_path {hf_path!r}: {folder}/config.json cannot be read "
                            f"by transformers: {str(e).splitlines()[0]}") from e
    if not hf:
        raise UserError("the model section names no Hugging Face model (model.hf or model.hf_path).")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if hf not in known:
        close = difflib.get_close_matches(hf, known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UserError(f"model.hf is {hf!r}, which is not a transformers model type "
                        f"(transformers {transformers.__version__}).{hint} Use a model type "
                        f"such as 'gpt2' or 'llama', not a hub name.")
    try:
        return transformers.AutoConfig.for_model(hf, **overrides)
    except (TypeError, ValueError) as e:
        raise UserError(f"model.hf_config for {hf!r} is invalid: {str(e).splitlines()[0]}") from e


def hf_section(model: Any) -> dict | None:
    """The model section that describes a Hugging Face model given to `dt.Job`:
    {"hf": its model type, "hf_config": its config's values that differ from the type's
    defaults}, stored in the Job's checkpoints so that `ckpt export --hf` rebuilds it;
    None for a module that is not a transformers `PreTrainedModel`. Imports nothing."""
    config = getattr(model, "config", None)
    if not (hasattr(config, "to_json_string") and getattr(config, "model_type", "")):
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
        raise UserError(f"{where}: model type {hf_config.model_type!r} has no causal language "
                        f"model class in transformers (AutoModelForCausalLM); disttrain trains "
                        f"causal LMs such as gpt2 or llama.") from e


def _stored_model_section(step_dir: Path) -> dict:
    state = step_dir / "state.json"
    try:
        config = json.loads(state.read_text()).get("config") or {}
    except (OSError, ValueError) as e:
        raise UserError(f"{state} cannot be read ({e}); is {step_dir} a disttrain checkpoint?") from e
    model = config.get("model") or {}
    if not (model.get("hf") or model.get("hf_path")):
        raise UserError(f"{step_dir} holds a model that is not a Hugging Face model (its config "
                        f"has no model.hf or model.hf_path); export it with --to model.safetensors.")
    return model


def export_hf(step_dir: str | os.PathLike, out_dir: str | os.PathLike,
              config_dir: str | os.PathLike | None = None) -> dict:
    """Write `out_dir` as a Hugging Face folder (safetensors + config.json) from the
    committed checkpoint `step_dir`. Verifies the manifest first. `config_dir` is the
    folder that a relative `model.hf_path` is taken from (default: the current one).
    Refuses a non-empty `out_dir`; writes into a temporary sibling, then renames.
    Raises `UserError` for a checkpoint of another model (names the first mismatches).
    Returns {'tensors', 'to', 'model_type'}."""
    import torch

    from disttrain.checkpoint.export import read_one, tensor_table

    step_dir, out = Path(step_dir), Path(out_dir)
    rows = {r[0]: r for r in tensor_table(step_dir) if r[0].startswith("model.")}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty folder; choose a new folder "
                        f"for --hf or remove it.")
    hf_config = hf_config_from_section(_stored_model_section(step_dir), config_dir)
    with torch.device("meta"):
        model = causal_lm_from_config(hf_config, f"{step_dir} model")
    prefix = "model." + HF_PREFIX if any(k.startswith("model." + HF_PREFIX) for k in rows) else "model."
    # Tied weights (GPT-2's LM head = embedding) are one Parameter held by two modules:
    # read it once and put the same Parameter in every holder, so the tie survives.
    groups: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    persistent = set(model.state_dict().keys())
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module.named_parameters(recurse=False, remove_duplicate=False),
                        *module.named_buffers(recurse=False, remove_duplicate=False)]:
            full = f"{mod_name}.{attr}".lstrip(".")
            if full in persistent:
                groups.setdefault(id(t), []).append((module, attr, full))
    used, missing, wrong = set(), [], []
    for holders in groups.values():
        names = [prefix + full for _, _, full in holders]
        found = [n for n in names if n in rows]
        if not found:
            missing.append(holders[0][2])
            continue
        used.update(found)
        key = found[0]
        old = getattr(holders[0][0], holders[0][1])
        if tuple(old.shape) != rows[key][1]:
            wrong.append(f"{holders[0][2]} is {tuple(old.shape)} in the model, {rows[key][1]} stored")
            continue
        value = read_one(step_dir, key).detach().to("cpu")
        new = torch.nn.Parameter(value, requires_grad=False) if isinstance(old, torch.nn.Parameter) else value
        for module, attr, _ in holders:
            setattr(module, attr, new)  # nn.Module files a known buffer's name under its buffers
    extra = sorted(k[len(prefix):] for k in rows if k.startswith(prefix) and k not in used)
    if missing or wrong or extra:
        parts = ([f"missing {', '.join(missing[:5])}"] if missing else []) + wrong[:5] + \
                ([f"unexpected {', '.join(extra[:5])}"] if extra else [])
        raise UserError(f"{step_dir} does not hold the model its config describes "
                        f"({hf_config.model_type}): {'; '.join(parts)}.")
    model.eval()
    try:  # one line of output from the CLI, not a progress bar per shard
        import_transformers().utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers < 5; 5 writes only safetensors
    try:
        model.save_pretrained(str(tmp), **kwargs)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"tensors": len(used), "to": str(out), "model_type": hf_config.model_type}
