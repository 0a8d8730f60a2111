"""Each rank's shard kept also in its buddy's CPU memory, so an in-memory recovery
under a sharded strategy (FSDP) gives a newcomer the dead rank's shard
(`[elastic] fast_recovery = true`, docs/elastic.md).

After every committed step the trainer calls `BuddyCopy.start(step, state)`: the rank
packs its own part of the `TrainState` (the local shards of the model and optimizer,
and the meta: scheduler, sampler, RNG) into a CPU buffer and posts an `isend` of it
to its buddy, rank (r + 1) % world, and an `irecv` of its left neighbour's pack, on a
gloo group of their own (CPU buffers, whatever the training backend). The copy runs
while the next step computes and is waited at the next `start`: a rank always holds
its own packs of the last two steps and its left neighbour's newest complete pack.

After a peer's death every rank offers the steps it holds (`offer`); the newest step
T whose every shard is held somewhere (by its owner, or by the dead owner's buddy) is
chosen (`choose_step`); the buddies send the newcomers their packs of T, and every
rank loads T (`restore`). Two neighbours dead at once leave a shard nowhere: T is
None and the caller loads the disk checkpoint. The state is copied raw (no pickling
of tensors): one flat uint8 buffer with a pickled skeleton in front.
"""

from __future__ import annotations

import datetime
import pickle
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disttrain.runtime import fault_injection

_HEADER = 16  # int64 skeleton length, then padding to 16 bytes
SALVAGE_WAIT_MS = 200
"""How long a survivor waits for a copy in flight when a peer has died: a copy that
had arrived completes at once; one from the dead rank fails at once (closed pair)."""


@dataclass(frozen=True)
class _Slot:
    """A tensor leaf of a packed state: its bytes in the buffer, and what they were."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dtensor: bool


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "to_local")


def _skeleton(tree: Any, leaves: list[tuple[_Slot, torch.Tensor]], offset: list[int]) -> Any:
    """`tree` with each tensor replaced by a `_Slot`; (slot, local shard) pairs go to
    `leaves` in order."""
    if isinstance(tree, dict):
        return {k: _skeleton(v, leaves, offset) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(v, leaves, offset) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if _is_dtensor(tree) else tree
        nbytes = local.numel() * local.element_size()
        slot = _Slot(offset[0], nbytes, local.dtype, tuple(local.shape), _is_dtensor(tree))
        offset[0] += -(-nbytes // 8) * 8  # 8-byte aligned, so every dtype views in place
        leaves.append((slot, local))
        return slot
    return tree


def pack(sd: dict, capacity: int | None = None) -> torch.Tensor:
    """`sd` (a `TrainState.state_dict()`) as one flat uint8 CPU tensor of `capacity`
    bytes (None: exactly what it needs). Raises `OverflowError` when it does not fit."""
    leaves: list[tuple[_Slot, torch.Tensor]] = []
    offset = [0]
    skeleton = pickle.dumps(_skeleton(sd, leaves, offset), protocol=pickle.HIGHEST_PROTOCOL)
    start = _HEADER + -(-len(skeleton) // 16) * 16
    need = start + offset[0]
    size = need if capacity is None else capacity
    if need > size:
        raise OverflowError(f"the state needs {need} bytes, the buffer holds {size}")
    buf = torch.empty(size, dtype=torch.uint8)
    buf[:8].view(torch.int64)[0] = len(skeleton)
    buf[_HEADER:_HEADER + len(skeleton)].copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    data = buf[start:]
    for slot, local in leaves:
        if slot.nbytes:
            data[slot.offset:slot.offset + slot.nbytes].copy_(local.detach().reshape(-1).view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, template: dict) -> dict:
    """The state dict packed in `buf`, its tensors copied out of the buffer. A DTensor
    leaf takes its mesh and placements from `template` (this rank's own
    `state_dict()`, same structure). Raises `KeyError` when the structures differ."""
    n = int(buf[:8].view(torch.int64)[0])
    skeleton = pickle.loads(buf[_HEADER:_HEADER + n].numpy().tobytes())
    data = buf[_HEADER + -(-n // 16) * 16:]
    return _fill(skeleton, data, template)


def _fill(tree: Any, data: torch.Tensor, template: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _fill(v, data, template[k] if isinstance(template, dict) and k in template else None)
                for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(v, data, template[i] if isinstance(template, (list, tuple))
                                and i < len(template) else None) for i, v in enumerate(tree))
    if not isinstance(tree, _Slot):
        return tree
    raw = data[tree.offset:tree.offset + tree.nbytes]
    local = (raw.view(tree.dtype) if tree.nbytes else torch.empty(0, dtype=tree.dtype)).reshape(tree.shape).clone()
    if not tree.dtensor:
        return local.to(template.device) if isinstance(template, torch.Tensor) else local
    if not _is_dtensor(template):
        raise KeyError("a sharded tensor of the buddy copy has no DTensor in this rank's state")
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(template.device), template.device_mesh, template.placements,
                              shape=template.shape, stride=template.stride(), run_check=False)


def choose_step(offers: list[dict]) -> int | None:
    """The newest step whose every shard is held: by its owner (`mine`), or, for a
    newcomer (an offer with `new` True), by the owner's buddy (`theirs` of rank
    (i + 1) % world). None when no step is complete."""
    world = len(offers)
    candidates = {s for o in offers for s in (*o["mine"], *o["theirs"])}
    for step in sorted(candidates, reverse=True):
        if all(step in (o["mine"] if not o["new"] else
                        (() if offers[(i + 1) % world]["new"] else offers[(i + 1) % world]["theirs"]))
               for i, o in enumerate(offers)):
            return step
    return None


class BuddyCopy:
    """The packs of one rank; kept across the attempts of a fast recovery.

    `mine`: step -> this rank's own pack (the last two); `theirs`: step -> the left
    neighbour's pack (the newest complete one). `attach(group)` binds the gloo group
    of the current generation."""

    def __init__(self) -> None:
        self.mine: dict[int, torch.Tensor] = {}
        self.theirs: dict[int, torch.Tensor] = {}
        self.group = None
        self._capacity: list[int] | None = None
        self._pending: tuple[int, list, torch.Tensor] | None = None
        self.disabled = False

    def attach(self, group) -> None:
        """A new generation's group: exchanges start over (capacities are gathered again)."""
        self.group, self._capacity, self._pending = group, None, None

    # ------------------------------------------------------------ every step
    def start(self, step: int, state) -> None:
        """Pack this rank's committed `state` of `step` and post the exchange with the
        buddies; the previous exchange is waited first. A collective of the buddy group
        (call it at the same step on every rank)."""
        if self.disabled or self.group is None:
            return
        self.finish()
        sd = state.state_dict()
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self._capacity is None:
            need = pack(sd).numel()
            mine_cap = need + need // 8 + 65536  # room for a skeleton that grows a little
            caps: list[int] = [0] * world
            dist.all_gather_object(caps, mine_cap, group=self.group)
            self._capacity = caps
        try:
            buf = pack(sd, self._capacity[rank])
        except OverflowError as e:
            self.disabled = True  # every later copy would not fit either; the disk checkpoint remains
            print(f"disttrain train: rank {rank}: the buddy copy is off for this run ({e})",
                  file=sys.stderr, flush=True)
            return
        self.mine[step] = buf
        for old in sorted(self.mine)[:-2]:
            del self.mine[old]
        incoming = torch.empty(self._capacity[(rank - 1) % world], dtype=torch.uint8)
        # The group spans the whole world in rank order: its ranks are the global ones.
        works = [dist.isend(buf, dst=(rank + 1) % world, group=self.group),
                 dist.irecv(incoming, src=(rank - 1) % world, group=self.group)]
        self._pending = (step, works, incoming)
        fault_injection.inject("buddy", step, dist.get_rank())

    def finish(self) -> None:
        """Wait for the exchange in flight; the received pack becomes `theirs`."""
        if self._pending is None:
            return
        step, works, incoming = self._pending
        self._pending = None
        for w in works:
            w.wait()
        self.theirs = {step: incoming}

    def salvage(self) -> None:
        """After a failure: keep the received pack in flight if it had arrived in full;
        never wait on the dead group."""
        pending, self._pending, self.group = self._pending, None, None  # the group is destroyed next
        if pending is None:
            return
        step, works, incoming = pending
        try:  # gloo marks a receive complete only in wait(): a short one, never a hang
            works[1].wait(datetime.timedelta(milliseconds=SALVAGE_WAIT_MS))
            self.theirs = {step: incoming}
        except Exception:  # noqa: BLE001 (the receive failed or did not finish: the older copy stays)
            pass

    # ------------------------------------------------------------ recovery
    def offer(self, newcomer: bool) -> dict:
        return {"new": newcomer, "mine": sorted(self.mine), "theirs": sorted(self.theirs),
                "sizes": {s: b.numel() for s, b in self.theirs.items()}}

    def restore(self, state, newcomer: bool, gen: int) -> bool:
        """A collective of the new generation (default group and buddy group): load the
        newest step every shard is held for into `state`. False when there is none
        (the caller loads the disk checkpoint)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        offers: list[dict] = [{}] * world
        dist.all_gather_object(offers, self.offer(newcomer))
        step = choose_step(offers)
        fault_injection.inject("recovery", -1 if step is None else step, rank)
        if step is None:
            if rank == 0:
                print(f"disttrain train: generation {gen}: no step has every shard in memory; "
                      f"loading the newest checkpoint", file=sys.stderr, flush=True)
            return False
        left, right = (rank - 1) % world, (rank + 1) % world
        works = []
        if offers[left]["new"]:  # this rank holds the dead left neighbour's shard
            works.append(dist.isend(self.theirs[step], dst=left, group=self.group))
        if newcomer:
            buf = torch.empty(offers[right]["sizes"][step], dtype=torch.uint8)
            works.append(dist.irecv(buf, src=right, group=self.group))
        for w in works:
            w.wait()
        own = buf if newcomer else self.mine[step]
        state.load_state_dict(unpack(own, state.state_dict()))
        self.mine = {step: own}
        self.theirs = {}
        if rank == 0:
            holders = [i for i, o in enumerate(offers) if o["new"]]
            print(f"disttrain train: generation {gen}: step {step} restored from memory "
                  f"(shards of ranks {holders} from their buddies)", file=sys.stderr, flush=True)
        return True
