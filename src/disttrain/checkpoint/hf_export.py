"""`disttrain ckpt export DIR --hf OUTDIR`: a checkpoint as a Hugging Face model folder.

The model's Hugging Face config comes from the checkpoint's own resolved config
(`state.json` -> `config.model`: `hf` + `hf_config`, or `hf_path`; a `dt.Job` stores
the section of a Hugging Face model it wrapped, `hf_section`). The model is built
empty on the meta device, each weight is read from the DCP checkpoint (gathered from
its shards, one tensor at a time) and put in place, and `save_pretrained` writes
safetensors plus `config.json`. `AutoModelForCausalLM.from_pretrained(OUTDIR)` then
gives the trained model's logits exactly. No process group is needed.

What the export shares with the trainer (how a model section names its Hugging Face
config, `hf_section`, `HF_PREFIX`) lives in `disttrain.config.hf_model_config`; those
names, read from here, still forward there with a `DeprecationWarning` for a release.
"""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

from disttrain import json_text
from disttrain.checkpoint import step_folders
from disttrain.checkpoint.own_files import read_own
from disttrain.config import hf_model_config
from disttrain.errors import UserError


def _stored_model_section(step_dir: Path) -> dict:
    """The model section of the checkpoint's state.json, checked for shape only: a
    table whose `hf` / `hf_path` are strings. What they say is judged by
    `hf_config_from_section`. Raises `UserError` naming the file."""
    state = step_dir / "state.json"
    try:  # parsed from the bytes checked against the manifest (`own_files.read_own`)
        record = step_folders.read_manifest(step_dir)["files"].get("state.json")
        stored = json_text.loads(read_own(step_dir, "state.json", record))
    except (OSError, ValueError) as e:
        raise UserError(f"{state} cannot be read ({e}); is {step_dir} a disttrain checkpoint?") from e
    config = stored.get("config") if isinstance(stored, dict) else None
    model = (config.get("model") if isinstance(config, dict) else None) or {}
    if not isinstance(model, dict) or not all(isinstance(model.get(k) or "", str) for k in ("hf", "hf_path")):
        raise UserError(f"{state}: config.model is not a table whose model.hf and model.hf_path are strings.")
    if not (model.get("hf") or model.get("hf_path")):
        raise UserError(
            f"{step_dir} holds a model that is not a Hugging Face model (its config "
            f"has no model.hf or model.hf_path); export it with --to model.safetensors."
        )
    return model


def export_hf(
    step_dir: str | os.PathLike, out_dir: str | os.PathLike, config_dir: str | os.PathLike | None = None
) -> dict:
    """Write `out_dir` as a Hugging Face folder (safetensors + config.json) from the
    committed checkpoint `step_dir`. Verifies the manifest first. `config_dir` is the
    folder that a relative `model.hf_path` is taken from (default: the current one);
    the `model.hf_path` folder must lie inside the checkpoint's folder (`step_dir`'s
    parent), and its config.json is opened without following a link.
    Refuses a non-empty `out_dir`; writes into a temporary sibling, then renames.
    Raises `UserError` for a checkpoint of another model (names the first mismatches).
    Returns {'tensors', 'to', 'model_type'}."""
    import torch

    from disttrain.checkpoint.export import read_one, tensor_table

    step_dir, out = Path(step_dir), Path(out_dir)
    rows = {r[0]: r for r in tensor_table(step_dir) if r[0].startswith("model.")}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty folder; choose a new folder for --hf or remove it.")
    # The stored section is data: hf_config_from_section builds a shipped config class
    # from its plain values and refuses anything that would choose code.
    hf_config = hf_model_config.hf_config_from_section(
        _stored_model_section(step_dir), config_dir, stored_in=str(step_dir / "state.json"), inside=step_dir.parent
    )
    with torch.device("meta"):
        model = hf_model_config.causal_lm_from_config(hf_config, f"{step_dir} model")
    adapter = "model." + hf_model_config.HF_PREFIX  # saved from HFCausalLM, not the bare model
    prefix = adapter if any(k.startswith(adapter) for k in rows) else "model."
    # Tied weights (GPT-2's LM head = embedding) are one Parameter held by two modules:
    # read it once and put the same Parameter in every holder, so the tie survives.
    groups: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    persistent = set(model.state_dict().keys())
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, t in [
            *module.named_parameters(recurse=False, remove_duplicate=False),
            *module.named_buffers(recurse=False, remove_duplicate=False),
        ]:
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
    extra = sorted(k[len(prefix) :] for k in rows if k.startswith(prefix) and k not in used)
    if missing or wrong or extra:
        parts = (
            ([f"missing {', '.join(missing[:5])}"] if missing else [])
            + wrong[:5]
            + ([f"unexpected {', '.join(extra[:5])}"] if extra else [])
        )
        raise UserError(
            f"{step_dir} does not hold the model its config describes ({hf_config.model_type}): {'; '.join(parts)}."
        )
    model.eval()
    try:  # one line of output from the CLI, not a progress bar per shard
        hf_model_config.import_transformers().utils.logging.disable_progress_bar()
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
