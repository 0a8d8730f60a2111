"""Global metrics (P-LOOP-1): a logged value is the global mean.

Every rank contributes a (sum, count) pair and one all-reduce adds them up; never an
average of per-rank averages, which is wrong when ranks see different numbers of samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.runtime.collectives import comm_device


def global_sum(values: list[float]) -> list[float]:
    """Element-wise sum of `values` over all ranks: a list of floats, the same on
    every rank.

    A collective (one float64 all-reduce, on the device the backend moves: CUDA under
    NCCL): every rank must call it with a list of the same length, or the ranks hang
    until the group's timeout. Without a process group it returns `values` as floats.
    """
    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def global_mean(local_sum: float, local_count: float) -> float:
    """The mean over all ranks: sum over ranks of `local_sum` / sum over ranks of
    `local_count`, the same on every rank.

    Weighted by each rank's count, so ranks with fewer samples (the last batch of an
    epoch) count for less. A collective (one all-reduce): every rank must call it.
    Returns nan when the global count is 0.
    """
    total, count = global_sum([float(local_sum), float(local_count)])
    return total / count if count else float("nan")


class MeanTracker:
    """A global mean built up locally: `update` adds to (sum, count) on this rank with
    no communication; `compute()` returns sum over ranks / count over ranks.

    `compute()` is a collective (one all-reduce): every rank must call it, also a rank
    that saw no values. It returns nan when no rank added anything. `reset()` starts
    again from zero on this rank.
    """

    def __init__(self) -> None:
        self.sum = 0.0
        self.count = 0.0

    def update(self, value: float | torch.Tensor, count: float = 1.0) -> None:
        """Add a per-sample `value` (a mean over `count` samples)."""
        self.sum += float(value) * count
        self.count += count

    def compute(self) -> float:
        """The global mean so far; a collective (see the class)."""
        return global_mean(self.sum, self.count)

    def reset(self) -> None:
        """Forget this rank's values (not a collective)."""
        self.sum, self.count = 0.0, 0.0
