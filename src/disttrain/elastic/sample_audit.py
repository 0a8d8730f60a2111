"""Which samples each optimizer step consumed, per rank and attempt, so a test (or a
user) can prove every sample was trained on exactly once across restarts and world
size changes (P-DATA-3).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def generation_id() -> int:
    """A number every rank of this attempt shares, larger than any earlier attempt's:
    rank 0's clock in ns, broadcast. (TORCHELASTIC_RESTART_COUNT is per agent, so two
    nodes that joined at different times would disagree.) A collective."""
    import time

    import torch.distributed as dist

    t = torch.tensor([time.time_ns()], dtype=torch.int64)
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return int(t.item())


class SampleAudit:
    """Appends {"step", "rank", "world", "generation", "time_ns", "indices"} lines, one file per
    rank and attempt, under `root`. A no-op when disabled."""

    def __init__(self, root: str | os.PathLike, rank: int, world_size: int, enabled: bool, generation: int = 0):
        self.enabled = enabled
        self.rank, self.world, self.generation = rank, world_size, generation
        self._pending: list[int] = []
        if enabled:
            root = Path(root)
            root.mkdir(parents=True, exist_ok=True)
            self.path = root / f"gen{generation}-rank{rank}.jsonl"

    def add(self, indices: torch.Tensor) -> None:
        if self.enabled:
            self._pending += indices.tolist()

    def commit(self, step: int) -> None:
        """Record the samples of optimizer step `step` (1-based), then start afresh."""
        if self.enabled:
            with self.path.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "rank": self.rank,
                            "world": self.world,
                            "generation": self.generation,
                            "time_ns": time.time_ns(),
                            "indices": self._pending,
                        }
                    )
                    + "\n"
                )
        self._pending = []


def final_timeline(records: list[dict]) -> dict[int, list[int]]:
    """The samples of each step on the timeline the final model descends from: for a
    step recorded by several attempts, the latest attempt's records replace the rest."""
    latest: dict[int, int] = {}
    for r in records:
        latest[r["step"]] = max(latest.get(r["step"], -1), r["generation"])
    out: dict[int, list[int]] = {}
    for r in records:
        if r["generation"] == latest[r["step"]]:
            out.setdefault(r["step"], []).extend(r["indices"])
    return out
