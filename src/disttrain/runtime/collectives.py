"""Small collectives on plain Python values, on a device the process group accepts
(NCCL takes CUDA tensors only, gloo CPU ones).

What a peer sends is never unpickled: values travel as tensors of numbers, or as JSON
text in a uint8 tensor (`all_gather_json`, `broadcast_json`), in place of torch's
`*_object` collectives, which pickle. A received text is parsed as JSON and checked
against the shape its caller expects (`conform`); anything else is refused
(`MalformedPeerValue`) before any of it is used.
"""

from __future__ import annotations

import json
import types
from typing import Any, Union, get_args, get_origin

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


MAX_JSON_BYTES = 64 << 20
"""The longest JSON text a rank accepts from another: disttrain's own values (a save's
file digests, a resume plan) are far shorter; a longer one is refused before it is
allocated."""


class MalformedPeerValue(DistributedMismatchError):
    """What a rank received from another is not the value disttrain sends there (not
    JSON, too long, or of another shape): refused, never interpreted. A rank of another
    disttrain version, or a process outside the job, sent it."""


def _refuse(who: str, what: str) -> MalformedPeerValue:
    return MalformedPeerValue(
        f"{who} sent {what}: refused, nothing of it used. Every rank must run the same disttrain "
        f"version, and only the job's own processes may reach its ranks (docs/security.md)."
    )


def _shape_name(shape: Any) -> str:
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {_shape_name(v)}" for k, v in shape.items()) + "}"
    name = shape.__name__ if isinstance(shape, type) and get_origin(shape) is None else str(shape)
    return name.replace("NoneType", "None").replace("typing.", "")


def _mismatch(value: Any, shape: Any, at: str) -> str:
    where = f" (at {at})" if at else ""
    return f"a value of type {type(value).__name__} where disttrain sends {_shape_name(shape)}{where}"


def _conform_one(value: Any, shape: Any, who: str, at: str) -> Any:
    """`value` checked against a shape that is not a union (see `conform`)."""
    origin, args = get_origin(shape), get_args(shape)
    if isinstance(shape, dict):
        if isinstance(value, dict) and set(value) == set(shape):
            return {k: conform(value[k], s, who, f"{at}.{k}" if at else k) for k, s in shape.items()}
    elif origin is tuple:
        if isinstance(value, list) and len(value) == len(args):
            return tuple(conform(v, s, who, at) for v, s in zip(value, args, strict=False))
    elif origin is list:
        if isinstance(value, list):
            return [conform(v, args[0], who, at) for v in value]
    elif origin is dict:
        if isinstance(value, dict):  # JSON's keys are strings
            return {k: conform(v, args[1], who, at) for k, v in value.items()}
    elif shape is None or shape is type(None):
        if value is None:
            return None
    elif shape is float:
        if type(value) in (int, float):
            return float(value)
    elif shape in (str, int, bool):
        if type(value) is shape:  # exact: JSON's true is no int here
            return value
    else:
        raise TypeError(f"conform has no rule for the shape {shape!r}")  # a caller's mistake
    raise _refuse(who, _mismatch(value, shape, at))


def conform(value: Any, shape: Any, who: str = "a rank", at: str = "") -> Any:
    """`value` (parsed JSON) checked against `shape`, rebuilt where JSON cannot say it
    (a tuple arrives as a list). Shapes: `Any` (any JSON), `str`, `int`, `float`,
    `bool`, `None`, `X | Y` (the first that fits), `tuple[...]` (a list of that
    length), `list[X]`, `dict[str, X]`, and a dict of key -> shape (exactly those
    keys). Raises `MalformedPeerValue` naming `who` (and the record key `at`) for a
    value of another shape."""
    if shape is Any:
        return value
    if get_origin(shape) in (Union, types.UnionType):
        for alternative in get_args(shape):
            try:
                return conform(value, alternative, who, at)
            except MalformedPeerValue:
                continue
        raise _refuse(who, _mismatch(value, shape, at))
    return _conform_one(value, shape, who, at)


def _json_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    """`obj` as JSON text in a uint8 tensor. Raises `TypeError` for a value JSON cannot
    hold (what would have needed a pickle)."""
    text = json.dumps(obj, allow_nan=True, separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)


def _check_size(n: int, who: str) -> int:
    if not 0 <= n <= MAX_JSON_BYTES:
        raise _refuse(who, f"a length of {n} bytes (at most {MAX_JSON_BYTES} are accepted)")
    return n


def _parsed(data: torch.Tensor, who: str, shape: Any) -> Any:
    """The JSON text in `data`, checked against `shape` (`conform`). Raises
    `MalformedPeerValue` for bytes that are not JSON (a pickle among them)."""
    try:
        value = json.loads(data.cpu().numpy().tobytes())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _refuse(who, "bytes that are not JSON") from None
    return conform(value, shape, who)


def all_gather_json(obj: Any, group: Any = None, shape: Any = Any) -> list[Any]:
    """Every rank's `obj` (plain JSON values: a tuple comes back a list, a dict's keys
    strings, unless `shape` rebuilds them: `conform`), in rank order; two all-gathers
    (the lengths, then the padded texts). A collective of `group` (the default one:
    None). Raises `MalformedPeerValue` on every rank when a rank's value is not JSON of
    `shape` or longer than `MAX_JSON_BYTES`."""
    device = comm_device(group)
    mine = _json_bytes(obj, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    lengths = [_check_size(int(t.item()), f"rank {r}") for r, t in enumerate(sizes)]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [_parsed(t[:n], f"rank {r}", shape) for r, (t, n) in enumerate(zip(out, lengths, strict=False))]


def broadcast_bytes(buf: torch.Tensor | None, src: int) -> torch.Tensor:
    """Rank `src`'s flat uint8 `buf` (None elsewhere) on every rank, on the CPU: its size,
    then its bytes, broadcast on the backend's device (CUDA under NCCL). A collective."""
    device = comm_device()
    size = torch.tensor([buf.numel() if buf is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    wire = (buf if buf is not None else torch.empty(int(size.item()), dtype=torch.uint8)).to(device)
    dist.broadcast(wire, src=src)
    return wire.cpu()


def broadcast_json(obj: Any, src: int, group: Any = None, shape: Any = Any) -> Any:
    """`obj` of rank `src` (plain JSON values, as in `all_gather_json`; `shape` as
    there) on every rank; two broadcasts. A collective of `group`; `src` is a global
    rank. Raises `MalformedPeerValue` on every rank when `src`'s value is not JSON of
    `shape` or longer than `MAX_JSON_BYTES`."""
    device = comm_device(group)
    text = _json_bytes(obj, device) if dist.get_rank() == src else None
    size = torch.tensor([text.numel() if text is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    n = _check_size(int(size.item()), f"rank {src}")  # on every rank, `src` too: all refuse alike
    if text is None:
        text = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(text, src=src, group=group)
    return _parsed(text, f"rank {src}", shape)


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
