"""The learning-rate question of P-LOOP-4: effective batch, scaled LR, warmup.

Effective batch B = per-device batch x world size x accumulation steps.

Scaling rule, as one continuous curve g(B) so that scaling *down* works the same way:

    g(B) = B                      for B <= 512    (linear scaling)
    g(B) = 512 * sqrt(B / 512)    for 512 < B <= 4096  (square root)
    g(B) = g(4096)                for B > 4096    (no further increase)

    scaled_lr = base_lr * g(B) / g(base_batch)

Between 512 and 1024, where P-LOOP-4 names no rule, we already use the square root,
continuing from the linear value at 512: the curve stays continuous, never grows faster
than linear, and from 1024 to 4096 it is exactly the square-root rule. Large-batch
results (Goyal et al. 2017; Hoffer et al. 2017; LAMB) show linear scaling breaking down
around a few hundred to a thousand samples, so the earlier switch is the safe side.

Warmup = min(5% of the total optimizer steps rounded, at least 1, 2000): the same rule
as `disttrain.train.accumulation.warmup_cosine(warmup_steps=-1)`, so plan and trainer agree. Schedulers
count optimizer steps, not micro-steps: with accumulation, `steps` is optimizer steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disttrain.config.lr_rule import LINEAR_UNTIL, SQRT_UNTIL, batch_scale
from disttrain.errors import UserError

WARMUP_FRACTION = 0.05
WARMUP_CAP = 2000


def rule_for(batch: float) -> str:
    if batch <= LINEAR_UNTIL:
        return f"linear (effective batch <= {LINEAR_UNTIL})"
    if batch <= SQRT_UNTIL:
        return f"square root (effective batch in ({LINEAR_UNTIL}, {SQRT_UNTIL}])"
    return f"held at the {SQRT_UNTIL} value (effective batch > {SQRT_UNTIL})"


def scaled_lr(base_lr: float, base_batch: int, effective_batch: int) -> float:
    """LR for `effective_batch`, given `base_lr` tuned at `base_batch`."""
    return base_lr * batch_scale(effective_batch) / batch_scale(base_batch)


def warmup_steps(total_steps: int) -> int:
    """min(round(5% of total optimizer steps), 2000), at least 1 (as warmup_cosine)."""
    return min(max(1, round(WARMUP_FRACTION * total_steps)), WARMUP_CAP)


@dataclass
class LRAdvice:
    """Answer to 'what learning rate and warmup for this many devices?'."""

    per_device_batch: int
    world: int
    accum_steps: int
    effective_batch: int
    base_lr: float | None
    base_batch: int
    scaled_lr: float | None
    factor: float
    """scaled_lr / base_lr."""
    rule: str
    total_steps: int | None
    warmup_steps: int | None

    def lines(self) -> list[str]:
        out = [
            f"effective batch = {self.per_device_batch} per device x {self.world} devices x "
            f"{self.accum_steps} accumulation steps = {self.effective_batch}"
        ]
        scale = f"x{self.factor:.3g} vs base batch {self.base_batch}, {self.rule}"
        if self.scaled_lr is not None:
            out.append(f"learning rate {self.base_lr:g} -> {self.scaled_lr:.4g} ({scale})")
        else:
            out.append(
                f"learning rate: multiply the base LR by {self.factor:.3g} ({scale}); pass --base-lr for the value"
            )
        if self.warmup_steps is not None:
            out.append(f"warmup {self.warmup_steps} of {self.total_steps} optimizer steps (min(5%, {WARMUP_CAP}))")
        return out


def advise(
    per_device_batch: int,
    world: int,
    accum_steps: int = 1,
    base_lr: float | None = None,
    base_batch: int = 256,
    total_steps: int | None = None,
) -> LRAdvice:
    """Effective batch, scaled LR and warmup. Raises UserError on impossible inputs."""
    if base_lr is not None and not (math.isfinite(base_lr) and base_lr > 0):
        raise UserError(f"--base-lr is {base_lr}; it must be a positive number such as 3e-4.")
    if base_batch < 1:
        raise UserError(f"--base-batch is {base_batch}; it must be at least 1 (the batch the base LR was tuned at).")
    if total_steps is not None and total_steps < 1:
        raise UserError(f"--steps is {total_steps}; it must be at least 1 (optimizer steps).")
    eff = per_device_batch * world * accum_steps
    factor = batch_scale(eff) / batch_scale(base_batch)
    return LRAdvice(
        per_device_batch=per_device_batch,
        world=world,
        accum_steps=accum_steps,
        effective_batch=eff,
        base_lr=base_lr,
        base_batch=base_batch,
        scaled_lr=None if base_lr is None else base_lr * factor,
        factor=factor,
        rule=rule_for(eff),
        total_steps=total_steps,
        warmup_steps=None if total_steps is None else warmup_steps(total_steps),
    )
