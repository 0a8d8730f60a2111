"""float16 training: without a loss scaler, and with a scaler whose skip decision
differs across ranks.

- **float16 without a loss scaler**: a training forward under `torch.autocast` with
  dtype float16 (seen at the model's top-level call, `model_watch`), or an optimizer
  holding float16 parameters, followed by an `optimizer.step()` that does not run
  inside an enabled `GradScaler.step`. float16 keeps 5 exponent bits: gradients below
  about 6e-8 underflow to zero, activations above 65504 overflow to inf. At the checked
  step the gradients are measured (the fraction exactly zero, the fraction inf or NaN):
  inf or NaN on any rank is a stop (the step writes them into the weights); otherwise a
  warning with the fraction of zeros (some are the model's own, a ReLU's; underflow
  adds to them).
- **a skip decision that differs across ranks**: `GradScaler.step` skips the step when
  the gradients it unscaled hold inf or NaN. It decides on each rank from that rank's
  gradients as `unscale_` saw them: when they differ across ranks (unscaled before the
  script's own all-reduce, or not reduced), one rank skips and another steps, and the
  replicas and the ranks' step counts part. `GradScaler.step` and `unscale_` are
  wrapped: the decision (any inf or NaN in the gradients `unscale_` left, or in the
  scaled gradients when `step` will unscale them itself) is compared across ranks
  before the original `step` runs, on every rank at the same call, when the optimizer
  step it leads to is a checked one -- a stop, before the ranks part.

Reads gradients only (float64 sums and counts); the scaler's own decision is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.amp import GradScaler

from disttrain.check.patches import Patches
from disttrain.check.verdicts import Finding, user_line

AUTOCAST_DEVICES = ("cuda", "cpu")
FIX = (
    "Fix: scale the loss with a torch.amp.GradScaler: scaler = torch.amp.GradScaler(device); "
    "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() -- it multiplies "
    "the loss so small gradients stay representable and skips the steps whose gradients "
    "overflow; or train in bfloat16 (autocast(dtype=torch.bfloat16)), which needs no scaler."
)


def fp16_autocast() -> bool:
    """Whether autocast to float16 is on now, for any device type checked."""
    return any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.float16 for d in AUTOCAST_DEVICES)


def grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def nonfinite(params: list[torch.Tensor]) -> bool:
    """Whether any gradient holds inf or NaN (a float64 sum keeps them, and a finite
    float32 tensor cannot overflow it)."""
    with torch.no_grad():
        return any(not bool(torch.isfinite(g.detach().sum(dtype=torch.float64))) for g in grads(params))


def grad_stats(params: list[torch.Tensor]) -> tuple[int, int, int]:
    """(gradient values, exactly zero, inf or NaN) over the parameters' gradients."""
    total = zeros = bad = 0
    with torch.no_grad():
        for g in grads(params):
            total += g.numel()
            zeros += int((g == 0).sum())
            bad += int((~torch.isfinite(g)).sum())
    return total, zeros, bad


class Float16Watch:
    """This rank's float16 training forwards and GradScaler calls, for the checked steps."""

    def __init__(
        self, upcoming: Callable[[], int | None], exchange: Callable[[list[float], bool], list | None]
    ) -> None:
        self.upcoming, self.exchange = upcoming, exchange
        """`upcoming()`: the number of the next optimizer step when it is checked, else
        None; `exchange(values, True)`: every rank's floats, as many on each (the checks'
        channel)."""
        self.fp16_line: str | None = None
        """The line of the first float16 training forward since the last step."""
        self.scaling = 0
        """Depth of enabled `GradScaler.step` calls running now."""
        self.unscaled: dict[int, tuple[bool, str | None]] = {}
        """id(optimizer) -> (inf/NaN after the user's own unscale_, its line)."""
        self.compared = 0
        """Scaled steps whose skip decisions were compared across ranks."""
        self.active = False
        self.report: Any = None
        self._patches = Patches()

    def install(self, report: Any) -> None:
        self.active, self.report = True, report
        self._patches.wrap(GradScaler, "unscale_", self._unscale)
        self._patches.wrap(GradScaler, "step", self._step)

    def remove(self) -> None:
        self.active = False
        self._patches.restore()

    def root_call(self, module: nn.Module, args: Any, output: Any) -> None:
        """A top-level forward (model_watch): a training one under float16 autocast is kept."""
        if self.fp16_line is None and torch.is_grad_enabled() and module.training and fp16_autocast():
            self.fp16_line = user_line()

    def pending(self, params: list[torch.Tensor] | None) -> bool:
        """Whether the step with `params` trains in float16 outside an enabled
        GradScaler.step (its gradients are to be measured)."""
        if params is None or self.scaling:
            return False
        return self.fp16_line is not None or any(p.dtype == torch.float16 for p in params)

    def take(self, params: list[torch.Tensor] | None) -> dict | None:
        """At a checked optimizer step with `params`: the gradients' measure when
        `pending`; None otherwise."""
        measure, line, self.fp16_line = self.pending(params), self.fp16_line, None
        if not measure or params is None:
            return None
        total, zeros, bad = grad_stats(params)
        return {"line": line, "total": total, "zeros": zeros, "bad": bad}

    def _unscale(self, original: Any) -> Any:
        def unscale_(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> Any:
            result = original(scaler, optimizer)
            if self.active and not self.scaling:  # the user's own call, not step's
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self.unscaled[id(optimizer)] = (nonfinite(params), user_line())
            return result

        return unscale_

    def _step(self, original: Any) -> Any:
        def step(scaler: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not (self.active and scaler.is_enabled()):
                return original(scaler, optimizer, *args, **kwargs)
            self._compare_skips(optimizer)
            self.scaling += 1
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                self.scaling -= 1

        return step

    def _compare_skips(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a scaled step that leads to a checked one: every rank's skip decision."""
        own = self.unscaled.pop(id(optimizer), None)
        step = self.upcoming()
        if step is None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        skips = own[0] if own is not None else nonfinite(params)
        rows = self.exchange([float(skips)], True)
        if rows is None:
            return
        self.compared += 1
        if len({float(r[0]) for r in rows}) == 1:
            return
        skipping = [r for r, row in enumerate(rows) if bool(row[0])]
        stepping = [r for r, row in enumerate(rows) if not bool(row[0])]
        text = _skips_text(step, skipping, stepping, user_line(), own[1] if own is not None else None)
        self.report.add(Finding("precision", True, text), "precision-skips")


def judge(rows: list[dict | None], step: int, step_line: str | None) -> list[tuple[str, Finding]]:
    """Every rank's `take()` at a checked step: float16 without a scaler (see the module)."""
    measured = [(r, row) for r, row in enumerate(rows) if row is not None and row["total"] > 0]
    if not measured:
        return []
    line = next((row["line"] for _, row in measured if row["line"]), None)
    bad = [(row["bad"] / row["total"], r) for r, row in measured if row["bad"]]
    if bad:
        share, rank = max(bad)
        return [("precision-fp16-bad", Finding("precision", True, _overflow_text(step, line, step_line, share, rank)))]
    share, rank = max((row["zeros"] / row["total"], r) for r, row in measured)
    return [("precision-fp16", Finding("precision", False, _no_scaler_text(step, line, step_line, share, rank)))]


def _forward(line: str | None) -> str:
    return f"the forward under torch.autocast(dtype=torch.float16) at {line}" if line else "float16 parameters"


def _overflow_text(step: int, line: str | None, step_line: str | None, share: float, rank: int) -> str:
    return (
        f"step {step}: training in float16 ({_forward(line)}) without a loss scaler, and "
        f"{share:.1%} of the gradient values are inf or NaN on rank {rank} at optimizer.step()"
        f"{f' at {step_line}' if step_line else ''}: float16 overflows above 65504, and this "
        f"step writes inf/NaN into the weights. {FIX}"
    )


def _no_scaler_text(step: int, line: str | None, step_line: str | None, share: float, rank: int) -> str:
    return (
        f"step {step}: training in float16 ({_forward(line)}) without a loss scaler: "
        f"{share:.1%} of the gradient values are exactly zero on rank {rank} at optimizer.step()"
        f"{f' at {step_line}' if step_line else ''}. float16 cannot hold gradients below about "
        "6e-8: they underflow to zero and those weights stop learning (and a value above 65504 "
        f"overflows to inf). {FIX}"
    )


def _skips_text(step: int, skipping: list[int], stepping: list[int], line: str | None, unscaled: str | None) -> str:
    def ranks(rs: list[int]) -> str:
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    why = (
        f"scaler.unscale_(optimizer) at {unscaled} checked each rank's own gradients, before they were averaged"
        if unscaled
        else "the gradients it checked differ across ranks (they were not averaged before scaler.step)"
    )
    verb = "s" if len(stepping) == 1 else "", "s" if len(skipping) == 1 else ""
    return (
        f"step {step}: GradScaler found inf/NaN gradients on {ranks(skipping)} and none on "
        f"{ranks(stepping)} at scaler.step(optimizer){f' at {line}' if line else ''}: {ranks(stepping)} "
        f"take{verb[0]} the step and {ranks(skipping)} skip{verb[1]} it, so the replicas part "
        f"and the ranks' step counts no longer match. Why: {why}. Fix: "
        "average the gradients first (DDP does it in backward), then scaler.unscale_(optimizer) "
        "and clip, then scaler.step(optimizer): every rank sees the same inf/NaN and skips the same steps."
    )
