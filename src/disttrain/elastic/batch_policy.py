"""The global-batch policy on a world-size change (P-ELASTIC-3, P-LOOP-4).

TorchElastic restarts workers; the script must load the latest checkpoint, rebuild
the sampler for the new world and continue. The trainer does that with
`Checkpointer.load` + `ElasticSampler` (exactly-once at any world size) + the policy
below. Dropout streams after a resume come from (seed, step, rank)
(`runtime.seed_step`), so a resume at the same world size is bit-exact.
"""

from __future__ import annotations

import torch

from disttrain.config.lr_rule import batch_scale
from disttrain.errors import UserError


def divisors_note(global_batch: int, batch_size: int) -> str:
    worlds = [w for w in range(1, global_batch + 1) if global_batch % (batch_size * w) == 0]
    return ", ".join(map(str, worlds))


def world_fits(policy: str, global_batch: int, batch_size: int, world_size: int) -> bool:
    """Whether training can go on at `world_size` data-parallel ranks with the global
    batch `global_batch` under `policy` (`apply_batch_policy` would not refuse it)."""
    return policy != "keep_global" or global_batch % (batch_size * world_size) == 0


def apply_batch_policy(
    policy: str,
    *,
    saved_global_batch: int,
    batch_size: int,
    world_size: int,
    accum_steps: int,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
) -> tuple[int, str | None]:
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
        if not world_fits(policy, saved_global_batch, batch_size, world_size):
            raise UserError(
                f"the checkpoint's global batch is {saved_global_batch}, which {world_size} ranks x "
                f"train.batch_size {batch_size} do not divide. Resume with a world size in "
                f"[{divisors_note(saved_global_batch, batch_size)}], change train.batch_size, or set "
                f"elastic.batch_policy = 'rescale_lr'."
            )
        accum = saved_global_batch // per_step
        return accum, (
            f"world size is now {world_size}: accum_steps {accum_steps} -> {accum} keeps "
            f"the global batch at {saved_global_batch}"
        )
    factor = batch_scale(new_global) / batch_scale(saved_global_batch)
    for group in optimizer.param_groups:
        group["lr"] *= factor
    if scheduler is not None:
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    return accum_steps, (
        f"world size is now {world_size}: global batch {saved_global_batch} -> "
        f"{new_global}, LR x {factor:.4f} (P-LOOP-4)"
    )
