"""Gradients carried from one optimizer step into the next: no zero_grad between them.

A script that steps on every micro-batch but zeroes only every k of them (or never)
applies each gradient again at every later step: step t sees the sum of all gradients
since the last zero_grad. Nothing fails; the model trains with a wrong, growing update.

The witness: a hook on each parameter (`Tensor.register_hook`, public) runs when
backward has computed that parameter's gradient, before it is added to `.grad`. At that
moment `.grad` shows whether it was reset since the optimizer's last step (None, or all
zeros: `zero_grad()`, with or without set_to_none, or by hand). A parameter whose every
backward since the step found `.grad` still holding values carried them over. The hooks
read `.grad`; they change no gradient. They are removed when the window closes.

DTensor parameters (FSDP2) are left out: their gradients are assigned whole after the
reduce-scatter, not accumulated by backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from disttrain.check.verdicts import Finding


@dataclass
class _Since:
    """One parameter since its optimizer's last step."""

    backwards: int = 0
    reset: bool = False


@dataclass
class GradResets:
    """The parameters watched, and what each backward found in their `.grad`."""

    since: dict[int, _Since] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def watch(self, params: list[torch.Tensor]) -> None:
        """Hook the parameters not hooked yet (leaves that require grad, not DTensor)."""
        for p in params:
            if id(p) in self.since or isinstance(p, DTensor) or not p.requires_grad or not p.is_leaf:
                continue
            self.since[id(p)] = _Since()
            self.handles.append(p.register_hook(self._hook(weakref.ref(p), self.since[id(p)])))

    @staticmethod
    def _hook(param: weakref.ref, since: _Since) -> Any:
        def seen(grad: torch.Tensor) -> None:
            p = param()
            if p is None:
                return
            since.backwards += 1
            if p.grad is None or not bool(p.grad.detach().any()):
                since.reset = True

        return seen

    def carried(self, params: list[torch.Tensor]) -> int:
        """How many of `params` had a backward since their last step, none of which
        found `.grad` reset."""
        states = [self.since.get(id(p)) for p in params]
        return sum(1 for s in states if s is not None and s.backwards > 0 and not s.reset)

    def stepped(self, params: list[torch.Tensor]) -> None:
        """The optimizer holding `params` stepped: their count starts over."""
        for p in params:
            state = self.since.get(id(p))
            if state is not None:
                state.backwards, state.reset = 0, False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def carried_finding(step: int, carried: int, total: int, line: str | None) -> Finding:
    where = f" at {line}" if line else ""
    return Finding(
        "accumulation",
        True,
        f"step {step}: optimizer.step(){where} applied gradients that still held those of the "
        f"step before ({carried} of {total} parameters): no zero_grad() ran between the two "
        "steps, so every step adds all the gradients since the last zero_grad() again. If "
        "the script accumulates micro-batches, it steps on each of them instead of once per "
        "window. Fix: call optimizer.step() and optimizer.zero_grad() together, once every "
        "accumulation window (after its last micro-batch's backward).",
    )
