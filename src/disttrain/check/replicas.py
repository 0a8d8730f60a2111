"""Replicas and their gradients, compared across ranks around each checked step.

Each tensor is reduced to two float64 numbers (its sum and its sum of absolute values);
the ranks compare them bit for bit (an all-reduce gives every rank the very same bits,
so replicas that are in step agree exactly). A gradient that is None is (0, -1), which
no tensor gives.

Which parameters must be replicas: those a DDP wraps, and those whose gradients are
identical on every rank at the step (the script averaged them itself). A model trained
apart on each rank (different gradients, no DDP) is not compared. DTensor parameters
(FSDP2, tensor parallel) hold different shards by design and are left out.

- Before the step (`before`): a DDP parameter whose gradients differ means DDP did not
  average them (a forward through `.module`, a step inside `no_sync()`); a replica
  parameter that differs was initialised or changed apart on each rank.
- After the step (`after`): a replica that was equal before the step, with averaged
  gradients, and differs after it was updated differently (the optimizer differs across
  ranks); a buffer of a replicated model that differs was set apart on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from disttrain.check.verdicts import Finding, ranks_text

NO_GRAD = (0.0, -1.0)


def checksum(t: torch.Tensor | None) -> tuple[float, float]:
    """(sum, sum of |x|) of `t` in float64; `NO_GRAD` for None. Reads `t` only."""
    if t is None:
        return NO_GRAD
    with torch.no_grad():
        t = t.detach()
        return float(t.sum(dtype=torch.float64)), float(t.abs().sum(dtype=torch.float64))


def plain(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that are whole tensors on every rank (not DTensor shards)."""
    return [p for p in params if not isinstance(p, DTensor)]


def before_values(params: list[torch.Tensor]) -> list[float]:
    """(grad sum, grad |sum|, param sum, param |sum|) per parameter, flat."""
    out: list[float] = []
    for p in params:
        out += [*checksum(p.grad), *checksum(p)]
    return out


def after_values(tensors: list[torch.Tensor]) -> list[float]:
    out: list[float] = []
    for t in tensors:
        out += checksum(t)
    return out


def _differ(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per entry (rows of `width` numbers): whether any rank differs from rank 0 bit for
    bit, and each rank's own mask of differences."""
    bits = [r.reshape(-1, width).view(torch.int64) for r in rows]
    each = [(b != bits[0]).any(dim=1) for b in bits]
    return torch.stack(each).any(dim=0), each


def _differing_ranks(each: list[torch.Tensor], i: int) -> list[int]:
    return [r for r, mask in enumerate(each) if bool(mask[i])]


@dataclass
class Context:
    """What a message needs: the step, the parameters' names, the user's lines."""

    step: int
    first: bool
    names: list[str]
    step_line: str | None
    bypass: str | None = None
    no_sync: bool = False


class Replicas:
    """The comparison across steps: which parameters were replicas, equal after the step."""

    def __init__(self) -> None:
        self.replica: torch.Tensor | None = None
        """Per parameter: a replica at the last step (DDP, or gradients averaged)."""
        self.equal_after: torch.Tensor | None = None
        self.compared = 0

    def before(self, rows: list[torch.Tensor], ddp: torch.Tensor, ctx: Context) -> Finding | None:
        """`rows`: each rank's `before_values` (same length on every rank); `ddp`: per
        parameter, whether a DDP averages it."""
        grads = [r.reshape(-1, 4)[:, :2].reshape(-1) for r in rows]
        values = [r.reshape(-1, 4)[:, 2:].reshape(-1) for r in rows]
        grad_differs, grad_each = _differ(grads, 2)
        has_grad = torch.stack([g.reshape(-1, 2)[:, 1] >= 0 for g in grads]).all(dim=0)
        value_differs, value_each = _differ(values, 2)
        unreduced = ddp & has_grad & grad_differs
        if bool(unreduced.any()):
            i = int(unreduced.nonzero()[0])
            return Finding("gradients", True, _unreduced_text(ctx, ctx.names[i], _differing_ranks(grad_each, i)))
        replica = ddp | (has_grad & ~grad_differs)
        drift = replica & value_differs
        self.compared += int(replica.sum())
        if bool(drift.any()):
            i = int(drift.nonzero()[0])
            was_equal = self.equal_after is not None and len(self.equal_after) > i and bool(self.equal_after[i])
            text = _drift_text(ctx, ctx.names[i], _differing_ranks(value_each, i), bool(ddp[i]), was_equal)
            return Finding("replicas", True, text)
        self.replica = replica
        return None

    def after(self, rows: list[torch.Tensor], n_params: int, buffer_names: list[str], ctx: Context) -> Finding | None:
        """`rows`: each rank's `after_values` of the parameters, then of the buffers."""
        differs, each = _differ(rows, 2)
        params = differs[:n_params]
        self.equal_after = ~params
        if self.replica is None or len(self.replica) != n_params:
            return None
        moved = self.replica & params
        if bool(moved.any()):
            i = int(moved.nonzero()[0])
            return Finding("replicas", True, _update_text(ctx, ctx.names[i], _differing_ranks(each, i)))
        buffers = differs[n_params:]
        if bool(self.replica.all()) and bool(buffers.any()):
            j = int(buffers.nonzero()[0])
            return Finding("replicas", True, _buffer_text(ctx, buffer_names[j], _differing_ranks(each, n_params + j)))
        return None


def _at(line: str | None) -> str:
    return f" at {line}" if line else ""


def _unreduced_text(ctx: Context, name: str, ranks: list[int]) -> str:
    head = (
        f"step {ctx.step}: the gradients of `{name}` differ across ranks before optimizer.step()"
        f"{_at(ctx.step_line)} ({ranks_text(ranks)}): DistributedDataParallel did not average them"
    )
    if ctx.bypass:
        return (
            f"{head}, because the forward at {ctx.bypass} called the wrapped model's `.module` "
            "directly, which skips DDP's gradient averaging; the replicas drift apart. Fix: call "
            "the DDP model itself for training (`model(x)`, not `model.module(x)`); use "
            "`.module` only to reach attributes or to save."
        )
    if ctx.no_sync:
        return (
            f"{head}, because the step ran inside `model.no_sync()`. Fix: accumulate under "
            "no_sync() and step only after the last micro-batch's backward, outside it."
        )
    return (
        f"{head}: your forward did not go through the DDP wrapper, or the gradients were "
        "changed after backward on some ranks. Fix: call the DDP model for every training "
        "forward, and change `.grad` the same way on every rank."
    )


def _drift_text(ctx: Context, name: str, ranks: list[int], ddp: bool, was_equal: bool) -> str:
    head = f"step {ctx.step}: the parameter `{name}` differs across ranks ({ranks_text(ranks)})"
    if was_equal:
        return (
            f"{head} before optimizer.step(){_at(ctx.step_line)}, though it was identical after the "
            f"step before: it was changed outside the optimizer, on some ranks or differently on "
            "each (an in-place edit, a rank-dependent branch, a load on one rank). Fix: change "
            "parameters only through the optimizer, or the same way on every rank."
        )
    if ddp:
        return (
            f"{head} before the first step checked, though DistributedDataParallel copies rank "
            "0's parameters to every rank when it wraps the model: it was changed after wrapping "
            "on some ranks. Fix: initialise or load the model before wrapping it, the same way "
            "on every rank."
        )
    return (
        f"{head} before optimizer.step(){_at(ctx.step_line)} while its gradients are averaged, "
        "so the replicas train apart"
        f"{' from the first step' if ctx.first else ''}: the parameters were initialised "
        "differently on each rank (a seed that depends on the rank). Fix: seed every rank the "
        "same before building the model (torch.manual_seed(seed)), or broadcast rank 0's "
        "parameters; DistributedDataParallel does both for you when it wraps the model."
    )


def _update_text(ctx: Context, name: str, ranks: list[int]) -> str:
    return (
        f"step {ctx.step}: the parameter `{name}` was identical on every rank before "
        f"optimizer.step(){_at(ctx.step_line)}, with averaged gradients, but differs after it "
        f"({ranks_text(ranks)}): the optimizer updates differently on each rank (a learning "
        "rate, weight decay or optimizer state that depends on the rank). Fix: build the "
        "optimizer and its scheduler the same way on every rank."
    )


def _buffer_text(ctx: Context, name: str, ranks: list[int]) -> str:
    return (
        f"step {ctx.step}: the buffer `{name}` differs across ranks after optimizer.step() "
        f"({ranks_text(ranks)}) while the parameters are replicas: it was set differently on "
        "each rank. Fix: set it the same way on every rank, or broadcast rank 0's "
        "(DistributedDataParallel does so at each forward with broadcast_buffers=True)."
    )
