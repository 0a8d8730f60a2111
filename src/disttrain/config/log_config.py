"""The `[log]` section: what rank 0 records besides metrics.jsonl (docs/observability.md).

Kept out of schema.py so that file stays one page; schema.py makes it a `Config` section.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class LogConfig:
    """Run records for people and tools; none of them changes training."""

    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files under {train.out_dir}/tb (losses, LR,
    gradient norm, throughput, per-rank step time and peak memory, restarts and
    world-size changes). false writes none."""
