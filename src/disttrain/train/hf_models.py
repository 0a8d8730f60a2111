"""Hugging Face causal LMs in `disttrain train`, built from a config (no download).

`[model] hf = "gpt2"` (any transformers model type) with `[model.hf_config]` overrides
builds `AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **hf_config))`;
`[model] hf_path = "DIR"` loads a local `save_pretrained` folder (relative to the
config file's folder), or builds from its config.json alone when it holds no weights.

`HFCausalLM` lets such a model train on (x, y) batches (the stdlib byte corpus) in
the same loop as the built-in GPT: `forward(x, y)` returns `(logits, loss)`. Its
state-dict keys are the Hugging Face model's own under the prefix `hf.`
(`HF_PREFIX`), which `disttrain ckpt export --hf` and the run's `model.pt` strip.
FSDP still shards per block:
`parallel.blocks.find_blocks` reads `_no_split_modules` from every submodule, so the
Hugging Face blocks (`GPT2Block`, `LlamaDecoderLayer`, ...) are found through it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from disttrain.config.hf_model_config import (
    HF_PREFIX,
    causal_lm_from_config,
    hf_config_from_section,
    import_transformers,
    resolve_hf_path,
)
from disttrain.errors import UserError

__all__ = ["HF_PREFIX", "HFCausalLM", "build_hf_model"]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def build_hf_model(model_cfg: Any, config_dir: str | os.PathLike | None = None) -> nn.Module:
    """The Hugging Face causal LM that the model section describes, in train mode,
    inside the `HFCausalLM` adapter (the bare model is its `.hf`).

    `model_cfg` is the `[model]` section (dataclass or dict) with `hf` + `hf_config`, or
    `hf_path` (+ optional `hf_config` overrides). `config_dir` is the config file's
    folder, which a relative `hf_path` is taken from (None: the current directory).
    Weights are random from the current torch seed (the same on every rank: disttrain
    seeds all ranks alike) unless `hf_path` holds weights, which are loaded. Nothing
    is downloaded (`local_files_only`). The adapter takes (x, y) batches (the byte
    corpus) and dict batches (`model(**batch)` -> the Hugging Face output, whose
    `.loss` needs `labels`) alike. Raises `UserError` when transformers is missing,
    the model type is unknown or has no causal-LM class, or the folder is missing or
    has no config.json.
    """
    hf_config = hf_config_from_section(model_cfg, config_dir)
    get = model_cfg.get if isinstance(model_cfg, dict) else lambda k: getattr(model_cfg, k, None)
    hf_path = get("hf_path")
    if hf_path:
        folder = resolve_hf_path(hf_path, config_dir)
        if any((folder / f).is_file() for f in _WEIGHT_FILES):
            transformers = import_transformers()
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(folder), config=hf_config, local_files_only=True
                )
            except (OSError, ValueError) as e:
                raise UserError(
                    f"model.hf_path {hf_path!r}: transformers cannot load {folder}: {str(e).splitlines()[0]}"
                ) from e
        else:
            model = causal_lm_from_config(hf_config, f"model.hf_path {hf_path!r}")
    else:
        model = causal_lm_from_config(hf_config, f"model.hf {get('hf')!r}")
    model.train()
    return HFCausalLM(model)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the built-in GPT's interface.

    `forward(x, y=None)` returns `(logits, loss)`: `x` are input ids (batch, time), `y`
    the targets already shifted by one (the byte corpus yields them so), and `loss`
    is `cross_entropy(logits.flatten(0, 1), y.flatten())`, exactly as `builtin.GPT`
    computes it (the Hugging Face `labels` path would shift a second time).
    `forward(**kwargs)` without `x` passes through to the Hugging Face model and
    returns its output (`output.loss` with `labels=`), for dict batches.

    The Hugging Face model is the submodule `hf`, so state-dict keys are its own
    keys prefixed with `HF_PREFIX` ("hf."); checkpoints and `ckpt export --hf` rely
    on that. The final `model.pt` is saved without the prefix (`export_prefix`).
    `_no_split_modules` stays on the inner model, where `find_blocks` finds it.
    Raises `ValueError` naming model.block_size when `x` is longer than the model's
    position count (`n_positions` / `max_position_embeddings`).
    """

    export_prefix = HF_PREFIX
    """The run's model.pt holds the Hugging Face model's own keys (this prefix stripped),
    so it loads with `load_state_dict(strict=True)` into the Hugging Face class."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model  # the attribute name is HF_PREFIX without its dot

    @property
    def config(self):
        """The Hugging Face config of the wrapped model."""
        return self.hf.config

    def forward(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None, **kwargs):
        if x is None:
            return self.hf(**kwargs)
        cfg: Any = self.hf.config
        limit = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
        if isinstance(limit, int) and x.shape[-1] > limit:  # else an IndexError deep inside
            raise ValueError(
                f"sequence length {x.shape[-1]} exceeds the {cfg.model_type} model's "
                f"{limit} positions: set model.block_size <= {limit} or raise "
                f"the position count in [model.hf_config]."
            )
        logits = self.hf(input_ids=x, use_cache=False, **kwargs).logits
        loss = None
        if y is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return logits, loss
