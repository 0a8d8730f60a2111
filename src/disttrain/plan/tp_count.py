"""What a model's tensor-parallel plan splits, read from a model built on the meta device.

The plan is the one `dt.wrap(tp=N)` applies without a `tp_plan` argument: a Hugging
Face model's published `base_model_tp_plan` (named from the model's root), else the
model's own `tp_plan` attribute (the built-in GPT's). Only 'colwise' and 'rowwise'
entries on linear layers count; the planner does not model other styles.

For each parameter, in `model.parameters()` order, the dimension TP splits (colwise: a
Linear's weight and bias by dim 0; rowwise: its weight by dim 1, its bias stays whole),
and for each planned Linear its style and widths, which give the activation collectives
(`plan.tp`). No torch.distributed import: counting stays as fast as the rest of the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disttrain.config.tp_rules import plan_matches

SPLIT_DIM = {("colwise", "weight"): 0, ("colwise", "bias"): 0, ("rowwise", "weight"): 1}
"""(style, parameter name) -> the dimension TP splits; absent: the parameter stays whole."""


def published_plan(model: Any) -> dict[str, str]:
    """The plan `dt.wrap(tp=N)` would use by default, by module pattern; {} when none, or
    when a Hugging Face plan has styles of its own (which `dt.wrap` refuses too)."""
    base = getattr(model, "base_model", None)
    hf = getattr(getattr(base, "config", None), "base_model_tp_plan", None)
    if isinstance(hf, Mapping) and hf:
        if {str(v) for v in hf.values()} - {"colwise", "rowwise"}:
            return {}
        prefix = next((name for name, m in model.named_modules() if m is base), "")
        return {f"{prefix}.{k}" if prefix else k: str(v) for k, v in hf.items()}
    own = getattr(model, "tp_plan", None)
    return {str(k): str(v) for k, v in own.items()} if isinstance(own, Mapping) else {}


def _style_of(name: str, plan: Mapping[str, str]) -> str | None:
    return next((style for pattern, style in plan.items() if plan_matches(pattern, name)), None)


def tp_facts(model: Any) -> tuple[list[int | None], list[tuple[str, int, int]]]:
    """(split dim per parameter, (style, in, out) per planned Linear) of `model` (an
    `nn.Module`) under its default plan; ([], []) when it has none."""
    import torch.nn as nn  # here: importing the planner must not import torch

    plan = published_plan(model)
    if not plan:
        return [], []
    dims: dict[int, int | None] = {}
    linears: list[tuple[str, int, int]] = []
    for name, module in model.named_modules():
        style = _style_of(name, plan) if isinstance(module, nn.Linear) else None
        if style in ("colwise", "rowwise"):
            linears.append((str(style), module.in_features, module.out_features))
        for pname, p in module.named_parameters(recurse=False):
            dims.setdefault(id(p), SPLIT_DIM.get((str(style), pname)))
    return [dims.get(id(p)) for p in model.parameters()], linears
