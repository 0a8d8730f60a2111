"""When a load may skip the work of torch's `set_state_dict`: DCP reads each tensor in
place, into the very tensors `get_state_dict` returned, so for a plain or DDP model
whose tensors are its parameters and buffers, `set_state_dict` copies every tensor
onto itself. Its cost is its name maps (an fqn lookup per parameter), not the copies.

- The model: `model_in_place` proves the copy is onto itself (each target tensor is
  exactly the parameter or buffer `load_state_dict` would copy it into, and that
  load only copies: `torch_compat.load_is_copy`); then nothing is left to do.
- The optimizer: its tensors were loaded in place too, but its `param_groups` (the
  learning rate, betas, ...) were read as new values. `optimizer_state` builds the
  fqn-keyed dict torch's `set_optimizer_state_dict` hands to the optimizer's own
  `load_state_dict` (its `_split_optim_state_dict`, for a non-FSDP optimizer whose
  groups hold the same parameters as the checkpoint's), so that call is torch's.

Anything else (FSDP's DTensors, ZeRO-1, hooks, groups that changed) returns False or
None: the caller then goes through `set_state_dict` as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from disttrain.runtime import torch_compat
from disttrain.runtime.torch_compat import canonical_name


def _alias(t: torch.Tensor) -> tuple:
    """What identifies the memory a tensor views (two equal aliases: one tensor)."""
    return (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def model_in_place(module: nn.Module, loaded: dict) -> bool:
    """True when `module.load_state_dict` of the loaded model state (`loaded`, keyed
    as torch's `get_state_dict` keys it, the tensors DCP read into) would copy every
    tensor onto itself: every value is a plain tensor that is exactly (memory, offset,
    shape, strides, dtype) every parameter or buffer of the same name, with wrapper
    parts dropped (`torch_compat.canonical_name` on both sides), and the module's load
    only copies."""
    if not torch_compat.load_is_copy(module):
        return False
    own = module.state_dict(keep_vars=True)  # the parameters and persistent buffers themselves
    if len(own) != len(loaded):
        return False
    by_name: dict[str, set] = {}
    for key, value in own.items():
        if not isinstance(value, torch.Tensor):
            return False  # an extra state: load_state_dict hands it over
        by_name.setdefault(canonical_name(key), set()).add(_alias(value))
    for key, value in loaded.items():
        if type(value) is not torch.Tensor or by_name.get(canonical_name(key)) != {_alias(value)}:
            return False
    return True


def optimizer_state(optim: Any, loaded: dict, fqns: list[list[str]] | None) -> dict | None:
    """The state dict torch's `set_optimizer_state_dict` would hand to
    `optim.load_state_dict` for the loaded optimizer state `loaded` (fqn keys, as
    `get_state_dict` gave them), or None when that is not provably this dict.

    `fqns`: the fqns of each group's parameters as `get_state_dict` named them before
    the load. Provable when `optim` is a `torch.optim.Optimizer`, every group is
    non-empty and the loaded groups name the same parameters in the same order: then
    torch's split keeps each group's parameters, takes the loaded group's values and
    the state of every parameter that requires a gradient."""
    if not isinstance(optim, torch.optim.Optimizer) or fqns is None:
        return None
    groups, state = loaded.get("param_groups"), loaded.get("state", {})
    if isinstance(state, dict) and all(isinstance(k, int) for k in state):
        return loaded  # torch's split hands such a dict (no state at all: SGD) over as it is
    if not isinstance(groups, list) or not (len(groups) == len(optim.param_groups) == len(fqns)):
        return None
    out_state, out_groups = {}, []
    for group, saved, names in zip(optim.param_groups, groups, fqns, strict=False):
        if not names or len(group["params"]) != len(names) or list(saved.get("params", ())) != names:
            return None
        for param, fqn in zip(group["params"], names, strict=False):
            if param.requires_grad:
                if fqn not in state:
                    return None  # torch raises for it (strict): let it
                out_state[fqn] = state[fqn]
        out_groups.append({"params": list(names), **{k: v for k, v in saved.items() if k != "params"}})
    return {"state": out_state, "param_groups": out_groups}
