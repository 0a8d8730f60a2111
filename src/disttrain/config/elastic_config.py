"""The `[elastic]` section: behaviour across restarts, world-size changes and the loss
of a worker (docs/elastic.md).

Kept out of schema.py so that file stays one page; schema.py makes it a `Config` section
and calls `check_elastic`.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.errors import ConfigError


@dataclass(kw_only=True)
class ElasticConfig:
    """[elastic]: behaviour across restarts, world-size changes and the loss of a worker
    (P-ELASTIC-3,5, P-DATA-3): the batch policy, preemption and in-memory recovery."""

    batch_policy: str = "keep_global"
    """On a world-size change: 'keep_global' keeps the global batch by re-deriving
    train.accum_steps (an error names the sizes that work when it does not divide);
    'rescale_lr' keeps accum_steps and scales the LR by the rule of P-LOOP-4."""
    preempt_grace_s: float = 60.0
    """After SIGTERM: seconds to finish the step and save before exiting 0."""
    record_samples: bool = False
    """Each rank appends (step, sample indices) to {out_dir}/samples/ for audits."""
    fast_recovery: bool = False
    """A killed worker is replaced by a warm spare with the survivors' state (docs/elastic.md)."""
    buddy_every: int = 1
    """Under fast_recovery with strategy fsdp: copy each rank's shard to its buddy's CPU
    memory every N optimizer steps. 1 loses only the step in flight on a kill; a larger
    N costs less per step (a large model's shard crosses the network each time) and
    redoes up to N steps."""
    rehearse_spares: bool = True
    """Under fast_recovery with strategy fsdp (tp = 1) on the CPU: a spare that
    stood by 3 s rehearses its first clip and optimizer step on a fake process group, so
    that its first step after a take-over does not work out torch's sharding plans
    (about 1 s of one core per spare; `train/spare_rehearsal.py`). False saves that CPU."""
    node_lease_s: float = 1.0
    """Under fast_recovery: a slot whose supervisor has not beaten on the job's store for
    this long is taken for gone with its node (it beats five times a lease). Shorter
    finds a lost node sooner; too short for a loaded host takes a slow node for a lost
    one, whose ranks then take torchrun's restart path."""


def check_elastic(e: ElasticConfig) -> None:
    """Raise `ConfigError` naming the bad `[elastic]` value and the fix."""
    if e.batch_policy not in ("keep_global", "rescale_lr"):
        raise ConfigError(
            f"config key 'elastic.batch_policy' is {e.batch_policy!r}; choose one of keep_global, rescale_lr."
        )
    if not e.preempt_grace_s > 0:
        raise ConfigError(f"elastic.preempt_grace_s is {e.preempt_grace_s}; it must be positive.")
    if (
        isinstance(e.node_lease_s, bool)
        or not isinstance(e.node_lease_s, int | float)
        or not (0.2 <= e.node_lease_s <= 60)
    ):
        raise ConfigError(
            f"elastic.node_lease_s is {e.node_lease_s!r}; give seconds between 0.2 and 60 (default 1.0: "
            f"a supervisor silent that long is taken for lost with its node)."
        )
    if isinstance(e.buddy_every, bool) or not isinstance(e.buddy_every, int) or e.buddy_every < 1:
        raise ConfigError(
            f"elastic.buddy_every is {e.buddy_every!r}; it must be a whole number >= 1 "
            f"(1: a buddy copy after every optimizer step)."
        )
