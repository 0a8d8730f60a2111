"""Where a checkpoint load's time goes on this rank: wall seconds per phase.

`Checkpointer.load` records its phases (`recording`); the functions it calls mark
theirs with `phase(name)`, which costs nothing when no load is recording. The record
of the last load is `Checkpointer.last_load_phases`, and its one-line `summary` is
logged at debug level: a slow load then says whether it waited on the disk
("reads"), on torch ("targets": `get_state_dict`), on parsing ("metadata", "plan")
or on another rank ("agree").

Phases, in the order a load meets them (a fallback past a damaged checkpoint adds
the second attempt's to the same names):

- `find`: rank 0 lists the committed checkpoints, every rank gets the list;
- `targets`: the state's tensors, what the load reads into (`get_state_dict`);
- `small files`: this rank's check of `.metadata`, `state.json` and its RNG file, and
  reading the manifest;
- `metadata`: parsing `.metadata`, comparing keys and shapes with the state;
- `agree`: waiting for every rank's verdict (twice: before and after the reads);
- `plan`: which bytes go where (`direct_load`, or DCP's planner inside `reads`);
- `reads`: reading, hashing and placing the data files;
- `share check`: hashing the files of this rank's share that it did not read;
- `hand over`: the state's JSON parts and `set_state_dict` into model and optimizer.

`total` is the load's whole wall time; the phases' sum falls short of it by the
bookkeeping between them, and in a process's first load by the imports of the load's
modules (about 50 ms).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from disttrain.runtime import processes


@contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Record the phases of the code inside into the dict this yields, with its
    `total`. Nested recordings are not supported: the inner one wins."""
    phases: dict[str, float] = {}
    outer, processes.STATE.load_phases = processes.STATE.load_phases, phases  # loads run on one thread
    start = time.perf_counter()
    try:
        yield phases
    finally:
        phases["total"] = time.perf_counter() - start
        processes.STATE.load_phases = outer


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the wall time of the code inside to phase `name` of the recording load."""
    phases = processes.STATE.load_phases
    if phases is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def summary(phases: dict[str, float]) -> str:
    """`total 0.551 s: find 1 ms, targets 20 ms, ...` (milliseconds, in recorded order)."""
    parts = [f"{name} {1000 * s:.0f} ms" for name, s in phases.items() if name != "total"]
    return f"total {phases.get('total', 0.0):.3f} s: " + ", ".join(parts)
