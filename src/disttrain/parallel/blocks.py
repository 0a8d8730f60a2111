"""Which submodules are the repeated blocks of a model, and per-block activation
checkpointing (P-FSDP-3, P-FSDP-6).

The block is the unit that FSDP shards (one all-gather and one reduce-scatter per
block) and the unit that activation checkpointing recomputes. `find_blocks` picks
it the way Hugging Face does: from the model's `_no_split_modules` class names,
which our own GPT declares too. A user can name the classes instead, or ask for
whole-model wrapping with `wrap = "model"`.
"""

from __future__ import annotations

import torch.nn as nn

from disttrain.errors import ConfigError
from disttrain.runtime import torch_compat


def _no_split_names(model: nn.Module) -> list[str]:
    # Hugging Face declares the attribute on the top model and on its inner model
    # (GPT2LMHeadModel -> GPT2Model); collect every declaration.
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or []:
            if name not in names:
                names.append(name)
    return names


def find_blocks(model: nn.Module, wrap: str = "auto") -> list[nn.Module]:
    """The block modules to shard or checkpoint, in forward (registration) order.

    `wrap`: 'auto' reads `_no_split_modules` (our GPT: `Block`; Hugging Face:
    `GPT2Block`, `LlamaDecoderLayer`, ...); a comma-separated list of class names
    selects those classes; 'model' returns no blocks (the whole model is one unit).
    Blocks nested inside another chosen block are dropped, so no module is wrapped
    twice. Raises `ConfigError` when named classes match nothing, naming the
    classes the model does contain. 'auto' on a model without `_no_split_modules`
    returns [] (whole-model wrapping), which is right for small models like the MLP.
    """
    if wrap == "model":
        return []
    names = _no_split_names(model) if wrap == "auto" else [n.strip() for n in wrap.split(",") if n.strip()]
    if not names:
        return []
    chosen = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not chosen and wrap != "auto":
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"parallel.wrap names {', '.join(names)}, but the model has no module of "
            f"that class. Classes in this model: {', '.join(present)}. Use 'auto', "
            f"'model', or one of these names."
        )
    inside: set[int] = set()
    for block in chosen:
        for sub in block.modules():
            if sub is not block:
                inside.add(id(sub))
    return [m for m in chosen if id(m) not in inside]


def check_tied_weights(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Refuse a wrap plan that splits a tied parameter across units.

    A tied weight (GPT's embedding = LM head) is one Parameter reachable from two
    modules. Sharding replaces it in the unit that owns it; a holder outside that
    unit would keep the stale, unsharded tensor and training would silently untie
    the two. Raises `ConfigError` naming the parameter and both holders.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append((module, f"{mod_name}.{p_name}".lstrip(".")))
    tied = [h for h in holders.values() if len({id(m) for m, _ in h}) > 1]
    for block in blocks:
        inside = {id(m) for m in block.modules()}
        for group in tied:
            n_in = sum(id(m) in inside for m, _ in group)
            if 0 < n_in < len(group):
                raise ConfigError(
                    f"parallel.wrap puts a tied parameter in two sharding units "
                    f"({', '.join(n for _, n in group)}). Tied weights must share "
                    f"one unit: wrap a module that contains all of them, or use "
                    f"'auto'."
                )


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Replace each block in its parent by a non-reentrant checkpoint wrapper (P-FSDP-6).

    Activations inside a block are recomputed in backward instead of kept. Parameter
    names and state-dict keys stay the same (the wrapper strips its own prefix), so
    checkpoints do not change. Returns the wrappers, which become the new blocks.
    Raises `ConfigError` when there is no block to checkpoint.
    """
    if not blocks:
        raise ConfigError(
            "parallel.activation_checkpointing needs blocks to checkpoint, but the "
            "model declares no `_no_split_modules`. Name the block classes with "
            'parallel.wrap = "MyBlock".'
        )
    targets = {id(b) for b in blocks}
    wrapped: list[nn.Module] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                # Non-reentrant: works with FSDP2 hooks and with inputs that need no grad.
                ac = torch_compat.checkpoint_wrap(child)
                setattr(parent, name, ac)
                wrapped.append(ac)
    return wrapped
