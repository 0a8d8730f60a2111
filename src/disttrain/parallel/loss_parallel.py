"""Loss parallel: the cross entropy computed on logits that stay split over the
vocabulary (docs/strategies.md "2D: tensor parallel x FSDP").

With `loss_parallel`, the plan leaves the output layer's logits a DTensor split on
the last dimension (`Shard(-1)`), and torch's `loss_parallel()` context makes the
cross entropy on them exchange only per-token sums (never the logits), in forward
and in backward. `install` enters that context around the model's forward, so the
loss its forward computes (the built-in GPT's) is the parallel one, and again in
that loss's backward, from the loss down to the logits' gradient, so whatever calls
`backward()` (`dt.Job`, `dt.Accumulator`, a loop of one's own) needs nothing more.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from disttrain.runtime.torch_compat import loss_parallel_active


class _Scope:
    """Torch's `loss_parallel()` entered once and left once, unless it was already
    entered (by the caller's own `with loss_parallel():`), which it then leaves alone."""

    def __init__(self) -> None:
        self._context: contextlib.AbstractContextManager | None = None

    def enter(self) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        if self._context is None and not loss_parallel_active():
            self._context = loss_parallel()
            self._context.__enter__()

    def leave(self, *_: Any) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)


class _EnterInBackward(torch.autograd.Function):
    """The identity on the loss, whose backward enters the scope: the loss's own
    backward (the cross entropy's, on DTensors) then runs inside it."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scope: _Scope) -> torch.Tensor:
        ctx.scope = scope
        return loss.clone()  # a copy, not the DTensor's local view: FSDP warns of views

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.scope.enter()
        return grad, None


def _plain_loss(output: Any) -> Any:
    """(logits, loss) with the loss, a replicated DTensor, as a plain tensor whose
    backward runs under the context until the logits' gradient is there; other
    outputs as they are."""
    if not (isinstance(output, tuple) and len(output) == 2 and hasattr(output[1], "to_local")):
        return output
    logits, loss = output
    if not (torch.is_grad_enabled() and loss.requires_grad and logits.requires_grad):
        return logits, loss.to_local().clone()
    scope = _Scope()
    logits.register_hook(scope.leave)  # the cross entropy's backward is done: leave
    return logits, _EnterInBackward.apply(loss.to_local(), scope)


def install(model: nn.Module) -> None:
    """Run `model`'s forward under torch's `loss_parallel()` (left after the forward,
    also when it raises) and return its (logits, loss) with the loss a plain tensor
    whose backward runs under it too. The logits stay a DTensor split over the
    vocabulary (their `full_tensor()` gathers them)."""
    scope = _Scope()

    def leave(module: nn.Module, args: tuple, output: Any) -> Any:
        scope.leave()
        return _plain_loss(output)

    model.register_forward_pre_hook(lambda module, args: scope.enter())
    model.register_forward_hook(leave, always_call=True)
