"""What a restarted or resized job needs beyond TorchElastic: the global-batch policy
on a world-size change, and an audit of the samples each step consumed
(P-ELASTIC-3, P-DATA-3, P-LOOP-4).

TorchElastic restarts workers; the script must load the latest checkpoint, rebuild
the sampler for the new world and continue. The trainer does that with
`Checkpointer.load` + `ElasticSampler` (exactly-once at any world size) + the policy
below. Dropout streams after a resume come from (seed, step, rank)
(`runtime.seed_step`), so a resume at the same world size is bit-exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from disttrain.errors import UserError
from disttrain.plan.lr import batch_scale


def divisors_note(global_batch: int, batch_size: int) -> str:
    worlds = [w for w in range(1, global_batch + 1) if global_batch % (batch_size * w) == 0]
    return ", ".join(map(str, worlds))


def apply_batch_policy(policy: str, *, saved_global_batch: int, batch_size: int, world_size: int,
                       accum_steps: int, optimizer: torch.optim.Optimizer, scheduler=None) -> tuple[int, str | None]:
    """Decide accum_steps (and the LR) for a world that differs from the checkpoint's.

    'keep_global': the global batch stays `saved_global_batch`; accum_steps becomes
    saved / (batch_size x world_size). Raises `UserError` naming the world sizes that
    divide when it does not. 'rescale_lr': accum_steps stays; every LR (and the
    scheduler's base LRs) is multiplied by g(new) / g(saved) of P-LOOP-4.
    Returns (accum_steps, a message for the log, or None when nothing changed).
    """
    new_global = batch_size * world_size * accum_steps
    if new_global == saved_global_batch:
        return accum_steps, None
    if policy == "keep_global":
        per_step = batch_size * world_size
        if saved_global_batch % per_step:
            raise UserError(
                f"the checkpoint's global batch is {saved_global_batch}, which {world_size} ranks x "
                f"train.batch_size {batch_size} do not divide. Resume with a world size in "
                f"[{divisors_note(saved_global_batch, batch_size)}], change train.batch_size, or set "
                f"elastic.batch_policy = 'rescale_lr'.")
        accum = saved_global_batch // per_step
        return accum, (f"world size is now {world_size}: accum_steps {accum_steps} -> {accum} keeps "
                       f"the global batch at {saved_global_batch}")
    factor = batch_scale(new_global) / batch_scale(saved_global_batch)
    for group in optimizer.param_groups:
        group["lr"] *= factor
    if scheduler is not None:
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    return accum_steps, (f"world size is now {world_size}: global batch {saved_global_batch} -> "
                         f"{new_global}, LR x {factor:.4f} (P-LOOP-4)")


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
    """Appends {"step", "rank", "world", "generation", "indices"} lines, one file per
    rank and attempt, under `root`. A no-op when disabled."""

    def __init__(self, root: str | os.PathLike, rank: int, world_size: int, enabled: bool,
                 generation: int = 0):
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
                f.write(json.dumps({"step": step, "rank": self.rank, "world": self.world,
                                    "generation": self.generation, "indices": self._pending}) + "\n")
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
