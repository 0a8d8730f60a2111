"""Small collectives on plain Python values, on a device the process group accepts
(NCCL takes CUDA tensors only, gloo CPU ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.errors import DistributedMismatchError


def comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_row(values: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's `values` as one tensor each, in rank order (one all-gather)."""
    local = torch.tensor(values, dtype=dtype, device=comm_device())
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return out


def gather_ints(value: int) -> list[int]:
    """Every rank's `value`, in rank order. `[value]` in a world of 1."""
    if not dist.is_initialized():
        return [value]
    return [int(t.item()) for t in _all_gather_row([value], torch.int64)]


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), in rank order; one
    all-gather. A collective: every rank must call it. `[values]` without a group."""
    if not dist.is_initialized():
        return [list(values)]
    return [t.tolist() for t in _all_gather_row(values, torch.float64)]


def assert_same_across_ranks(name: str, value: int) -> None:
    """Raise `DistributedMismatchError` on every rank when ranks disagree on `value`.

    A collective: every rank must call it at the same point. The message names each
    rank's value so the odd one out is obvious (P-DEBUG-3).
    """
    values = gather_ints(value)
    if len(set(values)) > 1:
        listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise DistributedMismatchError(
            f"ranks disagree on {name} ({listing}). Every rank must use the same {name}; "
            f"check per-rank config or environment overrides."
        )
