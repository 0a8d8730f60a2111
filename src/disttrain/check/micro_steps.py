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


def all_synced_finding(step: int, forwards: int, line: str | None) -> Finding:
    where = f" (the first at {line})" if line else ""
    return Finding(
        "accumulation",
        False,
        f"step {step}: {forwards} forwards through DistributedDataParallel{where} before one "
        f"optimizer.step(), none inside model.no_sync(): DDP all-reduced the gradients after "
        f"each of the {forwards} backwards, where one all-reduce per step is enough. Fix: run "
        "every micro-batch but the last under `with model.no_sync():`.",
    )
