"""Which models run, which are wrapped by DDP, and a forward that bypassed the wrapper,
seen through torch's global module hooks (public: `torch.nn.modules.module`).

- A module registration hook sees every `DistributedDataParallel` being built (it sets
  its `module` attribute): the wrapped module's parameters are the ones DDP averages.
- A forward pre-hook and an always-called forward hook keep the depth of module calls
  per thread. A module called at depth 0 is a root: the model the script called. A root
  that is a DDP's wrapped module was called through `.module`, outside DDP's forward;
  with gradients on, that forward's gradients are not averaged. Its line is kept as
  the witness the gradient check names. As a root call returns, `root_calls` hear of it
  (an evaluation, a float16 forward: `numbers`, `float16`).

The hooks only record; they change no input, output or gradient. They are removed when
the check window closes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.nn.parallel import DistributedDataParallel

from disttrain.check.verdicts import user_line
from disttrain.runtime.log import LOGGER
from disttrain.runtime.torch_compat import canonical_name


class ModelWatch:
    """The models seen by the global module hooks since the last optimizer step."""

    def __init__(self) -> None:
        self._depth = threading.local()
        self.roots: dict[int, nn.Module] = {}
        """Root modules called since the last `take_step` (by id)."""
        self.models: dict[int, nn.Module] = {}
        """Every root module called while the checks ran (names and buffers come from them)."""
        self.wrapped: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        """id(wrapped module) -> its DDP."""
        self.bypass: str | None = None
        """The line of the first forward through a DDP's `.module` since the last step."""
        self.forwards = self.synced = 0
        """Training forwards through a DDP since the last step, and those outside no_sync()."""
        self.forward_line: str | None = None
        self.root_calls: list[Callable[[nn.Module, Any, Any], None]] = []
        """Called with (module, args, output) as each top-level call returns (other checks')."""
        self._handles: list[Any] = []

    def install(self) -> None:
        self._handles = [
            module_hooks.register_module_module_registration_hook(self._registered),
            module_hooks.register_module_forward_pre_hook(self._entered),
            module_hooks.register_module_forward_hook(self._left, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if name == "module" and child is not None and isinstance(parent, DistributedDataParallel):
            self.wrapped[id(child)] = parent

    def _entered(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            self.roots[id(module)] = module
            if id(module) in self.wrapped and self.bypass is None and torch.is_grad_enabled():
                self.bypass = user_line()
            elif isinstance(module, DistributedDataParallel) and torch.is_grad_enabled():
                self.forwards += 1
                self.synced += bool(getattr(module, "require_backward_grad_sync", True))
                self.forward_line = self.forward_line or user_line()
        self._depth.n = depth + 1

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        depth = self._depth.n = max(0, getattr(self._depth, "n", 1) - 1)
        if depth == 0:
            for call in list(self.root_calls):
                try:
                    call(module, args, output)
                except Exception as e:  # noqa: BLE001  (a check's own fault must never reach the forward)
                    self.root_calls.remove(call)
                    LOGGER.warning(f"disttrain --check: a check failed ({type(e).__name__}: {e}) and stops.")

    def take_step(self) -> tuple[list[nn.Module], str | None]:
        """The roots called and the bypass line since the last call; both start over."""
        roots, bypass = list(self.roots.values()), self.bypass
        self.models.update(self.roots)
        self.roots, self.bypass = {}, None
        return roots, bypass

    def take_micro_steps(self) -> tuple[int, int, str | None]:
        """(training forwards through a DDP, those of them outside no_sync, the first's
        line) since the last call; all start over."""
        counts = (self.forwards, self.synced, self.forward_line)
        self.forwards = self.synced = 0
        self.forward_line = None
        return counts

    def ddp_params(self) -> set[int]:
        """ids of the parameters some live DDP averages."""
        return {id(p) for ddp in list(self.wrapped.values()) for p in ddp.parameters()}

    def ddp_grad_bytes(self) -> int:
        """The bytes of gradients one all-reduce of the live DDPs moves."""
        params = {id(p): p for ddp in list(self.wrapped.values()) for p in ddp.parameters() if p.requires_grad}
        return sum(p.numel() * p.element_size() for p in params.values())

    def strict_params(self) -> set[int]:
        """ids of the parameters that need a gradient at every step: trainable parameters
        of a live DDP built with find_unused_parameters=False (and no static graph)."""
        return {
            id(p)
            for ddp in list(self.wrapped.values())
            if not getattr(ddp, "find_unused_parameters", True) and not getattr(ddp, "static_graph", False)
            for p in ddp.parameters()
            if p.requires_grad
        }

    def outside_sync(self) -> bool:
        """Whether a live DDP is inside `no_sync()` now (it does not average gradients)."""
        return any(not getattr(ddp, "require_backward_grad_sync", True) for ddp in list(self.wrapped.values()))

    def names(self) -> dict[int, str]:
        """id(parameter or buffer) -> its name in the user's model (wrapper parts removed)."""
        found: dict[int, str] = {}
        for model in [*self.models.values(), *self.wrapped.values()]:
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                found.setdefault(id(t), canonical_name(name))
        return found

    def buffers(self, params: set[int]) -> list[tuple[str, torch.Tensor]]:
        """The buffers of the models that own any of `params`, by name, without the
        running statistics of norm layers (each rank's forward updates them from its own
        batch: they differ by design unless SyncBatchNorm is used)."""
        out: dict[int, tuple[str, torch.Tensor]] = {}
        for model in self.models.values():
            if not any(id(p) in params for p in model.parameters()):
                continue
            for prefix, sub in model.named_modules():
                if hasattr(sub, "track_running_stats"):
                    continue
                for name, b in sub.named_buffers(recurse=False):
                    out.setdefault(id(b), (canonical_name(f"{prefix}.{name}" if prefix else name), b))
        return list(out.values())
