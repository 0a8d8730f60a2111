"""How the model is wrapped, seen at a step: an optimizer that holds parameters the
model no longer has, and parameters DDP waits for that got no gradient.

An optimizer that holds parameters the model no longer has:

`fully_shard` replaces every parameter of the module it shards with a new DTensor
parameter; `load_state_dict(..., assign=True)` and rebuilding a layer replace them too.
An optimizer built before that keeps the old tensors: backward fills the new ones'
gradients, the old ones get none, and `optimizer.step()` changes nothing -- the model
never trains, and nothing fails. (DistributedDataParallel keeps the module's own
parameters, so an optimizer built before DDP still trains.)

The witness is exact: at a step where none of the optimizer's parameters has a
gradient, none of them is a parameter of any model the script called since the step
before (the roots of `model_watch`).

Unused parameters: DistributedDataParallel built with find_unused_parameters=False
waits, in every backward, for a gradient of each trainable parameter. One the forward
did not use never gets one: its bucket is not averaged, and DDP's next forward raises
an error that names parameter indices. The check names the parameters at the step
before, from the gradients every rank gathered: None on every rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def orphaned(params: list[torch.Tensor], roots: list[nn.Module]) -> bool:
    """Whether `params` (one optimizer's) have no gradient and belong to none of `roots`
    while those roots do have parameters. Reads only."""
    if not params or any(p.grad is not None for p in params):
        return False
    model = {id(q) for m in roots for q in m.parameters()}
    return bool(model) and not any(id(p) in model for p in params)


def orphaned_text(step: int, n_params: int, roots: list[nn.Module], line: str | None) -> str:
    models = ", ".join(sorted({type(m).__name__ for m in roots}))
    where = f" at {line}" if line else ""
    return (
        f"step {step}: none of the {n_params} parameters of the optimizer stepped{where} has a "
        f"gradient, and none of them belongs to the model that ran forward ({models}): the "
        "optimizer was built before fully_shard (or a load with assign=True, or a rebuilt "
        "layer) replaced the model's parameters, so the model never trains. Fix: build the "
        "optimizer after wrapping, from the wrapped model: fully_shard(model); optimizer = "
        "torch.optim.AdamW(model.parameters())."
    )


def unused_text(step: int, names: list[str], line: str | None) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    where = f" at {line}" if line else ""
    return (
        f"step {step}: the parameter `{names[0]}`{more} got no gradient on any rank before "
        f"optimizer.step(){where}: the forward did not use it, and DistributedDataParallel, "
        "built with find_unused_parameters=False, waits for its gradient, so the gradients "
        "of its bucket are not averaged and DDP's next forward fails (\"Expected to have "
        'finished reduction in the prior iteration"). Fix: remove the unused layer or freeze '
        "it (`requires_grad_(False)`) before wrapping, or build "
        "DistributedDataParallel(model, find_unused_parameters=True) if the forward skips "
        "layers on purpose."
    )
