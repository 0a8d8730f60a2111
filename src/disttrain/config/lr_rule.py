"""The one rule that scales the learning rate with the effective batch (P-LOOP-4),
shared by `disttrain plan` (advice) and the elastic batch policy (a resized job).
The curve and its sources are explained in `disttrain.plan.lr`.
"""

from __future__ import annotations

import math

LINEAR_UNTIL = 512
SQRT_UNTIL = 4096


def batch_scale(batch: float) -> float:
    """g(B): the LR multiplier of batch B, up to a constant. Linear to 512, square
    root to 4096, flat after."""
    if batch <= LINEAR_UNTIL:
        return float(batch)
    return LINEAR_UNTIL * math.sqrt(min(batch, SQRT_UNTIL) / LINEAR_UNTIL)
