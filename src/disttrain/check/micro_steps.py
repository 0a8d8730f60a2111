"""Gradient accumulation under DDP that all-reduces every micro-batch.

A script that runs several forwards and backwards per optimizer step accumulates
gradients. Under DDP each backward all-reduces them unless it runs inside
`model.no_sync()`; without it, k micro-batches cost k all-reduces per step instead of
one (P-DDP-5). The results are the same, so this is a warning: counted by
`model_watch` (training forwards through a DDP, and those outside no_sync) between two
optimizer steps.
"""

from __future__ import annotations

from disttrain.check.verdicts import Finding


def all_synced(forwards: int, synced: int) -> bool:
    """Several training forwards through a DDP in one step, none inside no_sync()."""
    return forwards > 1 and synced == forwards


def all_synced_finding(step: int, forwards: int, line: str | None, grad_bytes: int) -> Finding:
    """`grad_bytes`: the bytes of gradients one all-reduce of the DDP moves."""
    where = f" (the first at {line})" if line else ""
    extra = (forwards - 1) * grad_bytes
    return Finding(
        "accumulation",
        False,
        f"step {step}: {forwards} forwards through DistributedDataParallel{where} before one "
        f"optimizer.step(), none inside model.no_sync(): DDP all-reduced the gradients after "
        f"each of the {forwards} backwards, where one all-reduce per step is enough: "
        f"{forwards - 1} extra all-reduce{'s' if forwards > 2 else ''} of {_size(grad_bytes)} each, "
        f"{_size(extra)} more traffic per step. Fix: run every micro-batch but the last under `with model.no_sync():`.",
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
