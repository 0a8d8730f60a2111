"""Small collectives on plain Python values, on a device the process group accepts
(NCCL takes CUDA tensors only, gloo CPU ones).

What a peer sends is never unpickled: values travel as tensors of numbers, or as JSON
text in a uint8 tensor (`all_gather_json`, `broadcast_json`), in place of torch's
`*_object` collectives, which pickle.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from disttrain.errors import DistributedMismatchError


def comm_device(group: Any = None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    if dist.get_backend(group) == "nccl":
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


def _json_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    """`obj` as JSON text in a uint8 tensor. Raises `TypeError` for a value JSON cannot
    hold (what would have needed a pickle)."""
    text = json.dumps(obj, allow_nan=True, separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` (plain JSON values: a tuple comes back a list, a dict's keys
    strings), in rank order; two all-gathers (the lengths, then the padded texts). A
    collective of `group` (the default one: None)."""
    device = comm_device(group)
    mine = _json_bytes(obj, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(t.item()) for t in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(t[: int(n.item())].cpu().numpy().tobytes()) for t, n in zip(out, sizes)]


def broadcast_json(obj: Any, src: int, group: Any = None) -> Any:
    """`obj` of rank `src` (plain JSON values, as in `all_gather_json`) on every rank;
    two broadcasts. A collective of `group`; `src` is a global rank."""
    device = comm_device(group)
    text = _json_bytes(obj, device) if dist.get_rank() == src else None
    size = torch.tensor([text.numel() if text is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if text is None:
        text = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(text, src=src, group=group)
    return json.loads(text.cpu().numpy().tobytes())


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
