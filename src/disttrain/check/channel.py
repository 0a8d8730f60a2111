"""The checks' own way to compare numbers across ranks: a gloo process group of their
own, made with `dist.new_group` at the first checked step.

Why a group of our own: a collective on the user's group would sit in the same queue
as the user's collectives (DDP's buckets, FSDP's gathers), could reorder them on an
NCCL stream, and would change what `TORCH_DISTRIBUTED_DEBUG` sees. The new group's
collectives run on their own gloo connections, on CPU tensors, whatever the user's
backend. Every rank makes it at the same point (its first checked optimizer step), as
`new_group` requires, and every exchange after that happens at the same checked step on
every rank, so the calls always match.

An exchange that fails (the user destroyed the process groups, a peer is gone, the
group's timeout passed) turns the checks off on this rank with one warning; it never
raises into the user's program.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from disttrain import json_text
from disttrain.runtime.log import EVERY_RANK, LOGGER

MAX_JSON = 1 << 20
"""Bytes of JSON a rank sends in one `gather_json`."""


class Channel:
    """`gather(values)`: every rank's list of floats, in rank order, bit for bit;
    `gather_json(value)`: every rank's plain JSON value."""

    def __init__(self) -> None:
        self.group: object | None = None
        self.broken = False

    def world(self) -> int:
        """The ranks to compare (1 without a process group)."""
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def gather(self, values: list[float], fixed: bool = False) -> list[torch.Tensor] | None:
        """Every rank's `values` as float64 tensors, rank 0 first (their lengths may
        differ; `fixed`: every rank sends as many, and one all_gather is enough). A
        collective of the checks' group: every rank must call it at the same checked
        step. None once the channel is broken (see the module)."""
        mine = torch.tensor(values, dtype=torch.float64)
        world = self.world()
        if world == 1:
            return [mine]
        if self.broken:
            return None
        try:
            self._join()
            if fixed:
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine, group=self.group)
                return every
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64), group=self.group)
            longest = int(max(s.item() for s in sizes))
            padded = torch.zeros(longest, dtype=torch.float64)
            padded[: mine.numel()] = mine
            every = [torch.empty(longest, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, padded, group=self.group)
        except (RuntimeError, ValueError) as e:  # a torch.distributed error: the checks stop here
            self._broke(e)
            return None
        return [t[: int(n.item())] for t, n in zip(every, sizes, strict=False)]

    def gather_json(self, mine: Any) -> list[Any] | None:
        """Every rank's `mine` (plain JSON values: lists, dicts, strings, numbers), in rank
        order, sent as JSON text in a uint8 tensor (no pickle: what a peer sends is data,
        never code), at most `MAX_JSON` bytes a rank. The same rule as `gather`: every
        rank calls it at the same point; None once the channel is broken."""
        world = self.world()
        if world == 1:
            return [mine]
        if self.broken:
            return None
        data = json.dumps(mine, separators=(",", ":")).encode()[:MAX_JSON]
        try:
            self._join()
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
            longest = min(MAX_JSON, int(max(s.item() for s in sizes)))
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
            every = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
            dist.all_gather(every, padded, group=self.group)
            return [
                json_text.loads(bytes(t[: min(longest, int(n.item()))].tolist()))
                for t, n in zip(every, sizes, strict=True)
            ]
        except (RuntimeError, ValueError) as e:  # a torch.distributed error, or a peer's text cut or bad
            self._broke(e)
            return None

    def _join(self) -> None:
        if self.group is None:
            self.group = dist.new_group(backend="gloo")

    def _broke(self, e: Exception) -> None:
        self.broken = True
        LOGGER.warning(
            f"disttrain --check: rank {os.environ.get('RANK', '0')} could not compare with the other "
            f"ranks ({type(e).__name__}: {str(e)[:200]}); the checks stop.",
            extra=EVERY_RANK,
        )
