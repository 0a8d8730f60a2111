"""ZeRO-1 optimizer state in checkpoints, without consolidation (P-FSDP-9, P-CKPT-1).

`ZeroRedundancyOptimizer.state_dict()` works only after `consolidate_state_dict(to=R)`,
a collective that gathers the whole optimizer state on one rank, and then only on
that rank. A checkpoint does not need it: DCP writes each rank's keys itself. So
`ZeroView` shows torch's `get_state_dict` / `set_optimizer_state_dict` the ZeRO
optimizer as one optimizer over *all* parameters (its global `param_groups`, whose
learning rates the scheduler sets) that holds state for *this rank's partition*
only. The saved checkpoint is then in the ordinary fqn-keyed format: every rank
writes the moments of the parameters it owns, every parameter's state is saved
exactly once, and any strategy or world size can load it (each rank reads the
parameters it owns after the load).

Loading goes through the local optimizer's own `load_state_dict`, so the state is
copied (never aliased) onto the parameter's device, exactly as ZeRO would.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def is_zero(optimizer: Any) -> TypeGuard[ZeroRedundancyOptimizer]:
    """True for a `ZeroRedundancyOptimizer` (checked without importing
    `torch.distributed.optim`, which compiles TorchScript on import)."""
    module = sys.modules.get(_ZERO_MODULE)
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


class ZeroView:
    """What torch's state-dict helpers see for a `ZeroRedundancyOptimizer`.

    `param_groups` are ZeRO's global groups; `state` is the local optimizer's
    (this rank's partition). `state_dict()` indexes the local state by the global
    parameter order; `load_state_dict()` takes the same layout (fqn keys allowed,
    as `set_optimizer_state_dict` passes them) and loads the entries of this
    rank's partition into the local optimizer; entries of other ranks' parameters
    are ignored. No method communicates.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    @property
    def param_groups(self) -> list[dict]:
        return self.zero.param_groups

    @property
    def state(self):
        return self.zero.optim.state

    def _global_params(self) -> list[torch.Tensor]:
        return [p for g in self.zero.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """{"state": {global index: this rank's state}, "param_groups": global groups}."""
        local = self.zero.optim.state
        params = self._global_params()
        state = {i: local[p] for i, p in enumerate(params) if p in local}
        groups, start = [], 0
        for g in self.zero.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Set the global hyperparameters (learning rate ...) from `state_dict` and load
        the state of this rank's parameters into the local optimizer.

        `state_dict["param_groups"]` must list the parameters in the order of ZeRO's
        global groups (ids or names); raises `ValueError` if the group sizes differ.
        """
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.zero.param_groups]:
            raise ValueError(
                "the saved optimizer parameter groups do not match the ZeRO "
                "optimizer's groups (another model or parameter grouping)."
            )
        params = self._global_params()
        by_key = dict(zip((k for g in saved_groups for k in g["params"]), params, strict=False))
        for saved, group in zip(saved_groups, self.zero.param_groups, strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
        local_groups = self.zero.optim.param_groups
        local_index = {p: i for i, p in enumerate(p for g in local_groups for p in g["params"])}
        local_state = {}
        for key, value in state_dict["state"].items():
            p = by_key[key]
            if p in local_index:
                local_state[local_index[p]] = value
        # ZeRO's local groups mirror its global groups one for one (same hyperparameters).
        local_sd = {
            "state": local_state,
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [local_index[p] for p in lg["params"]]}
                for g, lg in zip(self.zero.param_groups, local_groups, strict=False)
            ],
        }
        self.zero.optim.load_state_dict(local_sd)

    def step(self, closure=None):
        """A local step only (torch's state initialisation calls it with zero gradients
        and lr 0): the local groups take the global hyperparameters first, and nothing
        is broadcast, since the parameters do not change."""
        for group, local in zip(self.zero.param_groups, self.zero.optim.param_groups, strict=False):
            local.update({k: v for k, v in group.items() if k != "params"})
        return self.zero.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)
