"""Tensor parallelism: each planned layer split over the ranks of a TP group, with
torch's `parallelize_module` (docs/strategies.md "2D: tensor parallel x FSDP").

A plan maps module names to how each is split. A name may hold `*` for one part of
a dotted name (`blocks.*.attn.q` is every block's `attn.q`); a style is a string or
torch's own `ParallelStyle` object:

    colwise   ColwiseParallel    output features split: each rank computes its columns
    rowwise   RowwiseParallel    input features split: the partial outputs are summed
    sequence  SequenceParallel   a norm or dropout run on a slice of the sequence

The plan is `dt.wrap(..., tp_plan=...)`'s, else the one a Hugging Face model publishes
(`config.base_model_tp_plan`, Llama's for example), else the model's own `tp_plan`
attribute (the built-in GPT has one: q, k, v and the MLP's first layer colwise, the
attention's output projection and the MLP's second layer rowwise). TP is applied before the
data-parallel strategy (FSDP shards the resulting DTensors over the data-parallel
mesh, the order of torch's 2D examples).
"""

from __future__ import annotations

import difflib
import re
import zlib
from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from disttrain.config.tp_rules import TP_STYLES, divisors, plan_matches
from disttrain.errors import UserError
from disttrain.runtime.collectives import assert_same_across_ranks

STYLES = dict(zip(TP_STYLES, (ColwiseParallel, RowwiseParallel, SequenceParallel), strict=True))
"""The plan's words (`config.tp_rules.TP_STYLES`) and the torch styles they stand for."""


def _style(pattern: str, style: object) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]()
    raise UserError(
        f"tp_plan[{pattern!r}] is {style!r}; use one of {', '.join(map(repr, STYLES))} or a "
        f"torch.distributed.tensor.parallel ParallelStyle object."
    )


def _matches(pattern: str, names: list[str]) -> list[str]:
    return [n for n in names if plan_matches(pattern, n)]


def _nearest(pattern: str, names: list[str]) -> list[str]:
    """The module names closest to `pattern` (its `*` read as any one part), at most 4."""
    shapes = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", n): n for n in reversed(names)}
    close = difflib.get_close_matches(pattern, list(shapes), n=4, cutoff=0)
    return [shapes[c] for c in close]


def hugging_face_plan(model: nn.Module) -> dict[str, object]:
    """A Hugging Face model's own plan (its config's `base_model_tp_plan`), named from
    `model`'s root; {} when no submodule is a Hugging Face base model with one. Only its
    'colwise' and 'rowwise' entries have torch styles: another is a `UserError` that
    asks for a plan of one's own."""
    for prefix, module in model.named_modules():
        published = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if published and getattr(module, "base_model", None) is module:
            other = sorted({str(v) for v in published.values()} - {"colwise", "rowwise"})
            if other:
                raise UserError(
                    f"the Hugging Face plan of {type(module).__name__} uses the styles {other}, which "
                    f"have no torch equivalent here; pass dt.wrap(..., tp_plan={{...}}) with 'colwise', "
                    f"'rowwise' or torch ParallelStyles."
                )
            return {f"{prefix}.{key}" if prefix else key: style for key, style in published.items()}
    return {}


def _options_plan(model: nn.Module, tp_plan: Mapping[str, object] | None, options: dict[str, bool]):
    """The model's own plan with sequence or loss parallel (`tp_plan_for`); raises
    `UserError` when a plan is given or the model offers no such plan."""
    wanted = [name for name, on in options.items() if on]
    offer = getattr(model, "tp_plan_for", None)
    if tp_plan is not None or not callable(offer):
        whose = "a tp_plan of your own" if tp_plan is not None else f"{type(model).__name__}, which has no tp_plan_for"
        raise UserError(
            f"{wanted[0]}=True extends the built-in GPT's own plan, not {whose}; write torch's "
            f"SequenceParallel / ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) into "
            f'tp_plan instead (docs/strategies.md "2D").'
        )
    return offer(**options)


def resolve_plan(
    model: nn.Module,
    tp_plan: Mapping[str, object] | None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The plan by exact module name: `tp_plan`, else the Hugging Face plan
    (`hugging_face_plan`), else the model's `tp_plan` attribute; with
    `sequence_parallel` or `loss_parallel`, the model's `tp_plan_for(...)`.

    Raises `UserError` for a model with neither, an unknown style, an entry that
    names no module of the model (with a few of its module names), or an option the
    plan cannot take (a plan of one's own, a model without `tp_plan_for`).
    """
    options = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    if any(options.values()):
        plan = _options_plan(model, tp_plan, options)
    else:  # a Hugging Face model's own `tp_plan` holds styles of its own: its base model's plan first
        plan = tp_plan if tp_plan is not None else hugging_face_plan(model) or getattr(model, "tp_plan", None)
    if not plan:
        raise UserError(
            f"parallel.tp > 1 needs a plan, and {type(model).__name__} has no tp_plan attribute (nor a "
            f'Hugging Face base_model_tp_plan); pass dt.wrap(..., tp_plan={{"layers.*.q": "colwise", ...}}) '
            f"(or dt.Job(tp_plan=...))."
        )
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        found = _matches(pattern, names)
        if not found:
            raise UserError(
                f"tp_plan entry {pattern!r} names no module of {type(model).__name__}; the nearest "
                f"are {', '.join(_nearest(pattern, names))} ('*' stands for one part of a name)."
            )
        parsed = _style(pattern, style)
        out.update(dict.fromkeys(found, parsed))
    return out


def _weight_layout(module: nn.Module, style: ParallelStyle | None) -> str | None:
    """How the style lays out `module`'s weight over the TP group: the dimension split
    (a Linear's rows when colwise, an Embedding's rows when rowwise), 'whole' for a copy
    on each rank (sequence parallel), None when it leaves the weight alone."""
    if isinstance(style, SequenceParallel):
        return "whole"
    colwise = isinstance(style, ColwiseParallel)
    if not (colwise or isinstance(style, RowwiseParallel)):
        return None
    return "rows" if colwise != isinstance(module, nn.Embedding) else "columns"


def _split_width(module: nn.Module, style: ParallelStyle) -> int | None:
    """The size the style splits: a Linear's output (colwise) or input (rowwise)
    features, an Embedding's width (colwise) or rows (rowwise); None for others."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    colwise = isinstance(style, ColwiseParallel)
    if not (colwise or isinstance(style, RowwiseParallel)):
        return None
    if isinstance(module, nn.Embedding):
        colwise = not colwise
    return int(weight.shape[0] if colwise else weight.shape[1])


def _fits(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> str | None:
    """The first planned layer that `tp` does not split evenly, in words; None if all do."""
    for name, style in plan.items():
        module = model.get_submodule(name)
        width = _split_width(module, style)
        if width is not None and width % tp:
            return f"{name} ({width} wide)"
        parent = model.get_submodule(name.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(style, ColwiseParallel) and isinstance(head_dim, int) and width and (width // tp) % head_dim:
            return f"{name} ({width // head_dim} heads)"
    return None


def check_plan(model: nn.Module, plan: dict[str, ParallelStyle], tp: int, world_size: int) -> None:
    """Refuse a degree that splits a planned layer unevenly or one attention head, or a
    plan that splits a weight tied to another layer. Raises `UserError` naming the
    degrees that work."""
    for holders in _tied(model):
        layouts = {o: _weight_layout(model.get_submodule(o), plan.get(o)) for o in holders}
        split = next((o for o, layout in layouts.items() if layout is not None), None)
        other = next((o for o, layout in layouts.items() if split and layout != layouts[split]), None)
        if split is not None and other is not None:  # the holders would get two different weights
            raise UserError(
                f"tp_plan splits {split}, whose weight is tied to {other}; leave it out of the plan, "
                f"split {other} the same way (a tied LM head colwise, its embedding rowwise), or untie "
                f"the weights."
            )
    bad = _fits(model, plan, tp)
    if bad is not None:
        good = [d for d in divisors(world_size) if _fits(model, plan, d) is None]
        raise UserError(f"parallel.tp = {tp} does not split {bad} evenly; use one of {good}.")


def _tied(model: nn.Module) -> list[dict[str, str]]:
    """Each parameter held by more than one module (a tied embedding and LM head), as
    {holder's module name: the attribute it holds it under}."""
    owners: dict[int, dict[str, str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), {})[name] = attr
    return [holders for holders in owners.values() if len(holders) > 1]


def _check_sequence(module: nn.Module, args: tuple, tp: int) -> None:
    t = args[0].shape[1] if args and hasattr(args[0], "shape") and args[0].dim() > 1 else 0
    if t % tp:
        raise UserError(
            f"sequence_parallel splits the sequence over tp = {tp}, and this batch's is {t} long; "
            f"use a sequence length (block size) that divides by {tp}."
        )


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    tp_plan: Mapping[str, object] | None,
    *,
    world_size: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Split the planned layers of `model` (already on its device) over the 1D TP
    `mesh`, in place; return it. `sequence_parallel` / `loss_parallel` take the model's
    `tp_plan_for` plan with those options (its forward then refuses a sequence that does
    not divide by the degree). Weights tied across layers that the plan splits the same
    way stay tied. The plan's checks (`resolve_plan`, `check_plan`) raise `UserError`
    before anything changes, and ranks whose plans differ raise
    `DistributedMismatchError` on every rank. A collective: every rank of the job
    calls it."""
    plan = resolve_plan(model, tp_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    check_plan(model, plan, mesh.size(), world_size)
    # A rank with another plan would exchange activations of other shapes: refuse it.
    described = ";".join(f"{name}={type(style).__name__}" for name, style in sorted(plan.items()))
    assert_same_across_ranks("tensor-parallel plan (a checksum of names and styles)", zlib.crc32(described.encode()))
    ties = [list(holders.items()) for holders in _tied(model) if set(holders) <= set(plan)]
    model = parallelize_module(model, mesh, plan)
    for (first, attr), *others in ties:  # each holder got its own split copy: one Parameter again
        shared = getattr(model.get_submodule(first), attr)
        for other, other_attr in others:
            setattr(model.get_submodule(other), other_attr, shared)
    if sequence_parallel:
        model.register_forward_pre_hook(lambda module, args: _check_sequence(module, args, mesh.size()))
    return model
