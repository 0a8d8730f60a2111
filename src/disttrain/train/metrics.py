"""Global metrics and rank-0 output (P-LOOP-1).

A logged loss is the global mean: every rank contributes a (sum, count) pair and
one all-reduce adds them up. Never an average of per-rank averages, which is wrong
when ranks see different numbers of samples.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain.runtime import rank_info
from disttrain.runtime.collectives import comm_device
from disttrain.runtime.log import current_rank


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


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: `torch.cuda.max_memory_allocated` on a CUDA
    rank (tensors only), the peak resident set size of the process on a CPU rank."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class StepClock:
    """This rank's wall time per optimizer step between two `lap` calls. A window that
    holds an evaluation or a checkpoint save counts that time too."""

    def __init__(self, step: int):
        self.t, self.step = time.perf_counter(), step

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.t) / max(step - self.step, 1)
        self.t, self.step = now, step
        return per_step


class JsonlWriter:
    """Appends one JSON object per line to `path`, on rank 0 only; a no-op elsewhere.

    Rank 0 creates the parent folder at construction. Each `write(record)` opens the
    file, appends `json.dumps(record)` and a newline and closes it, so a kill loses at
    most the line being written (readers skip a cut last line). Not a collective; a
    record that `json` cannot encode raises `TypeError` on rank 0.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.enabled = rank_info().is_main
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        """Append `record` as one line (rank 0); nothing on other ranks."""
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def print_main(*args, **kwargs) -> None:
    """`print(*args, **kwargs)` on global rank 0 only, flushed; other ranks print nothing.
    The rank is the process group's, or before one exists (before `with dt.Job(...)`)
    the launcher's RANK, so a line is printed once per job.

    Not a collective: it never waits for the other ranks, so it is safe in code that
    only some ranks run.
    """
    if current_rank() == 0:
        print(*args, **kwargs, flush=True)
