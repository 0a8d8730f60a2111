"""Each rank's shard kept also in its buddy's CPU memory, so an in-memory recovery
under a sharded strategy (FSDP) gives a newcomer the dead rank's shard
(`[elastic] fast_recovery = true`, docs/elastic.md).

After every committed step the trainer calls `BuddyCopy.start(step, state)`: the rank
packs its own part of the `TrainState` (the local shards of the model and optimizer,
and the meta: step, scheduler, sampler, scaler) into a CPU buffer and posts an `isend` of it
to its buddy and an `irecv` of the pack of the rank whose buddy it is, on a gloo group
of their own (CPU buffers, whatever the training backend). The buddy is on another
node when there are several (`buddy_shift`: the rank with the same local rank on the
next node), so a lost machine leaves every one of its shards on a survivor; on one
node it is rank (r + 1) % world. The copy runs while the next step computes and is
waited at the next `start`: a rank always holds its own packs of the last two steps
and its source's newest complete pack.

After a peer's death every rank offers the steps it holds (`offer`); the newest step
T whose every shard is held somewhere (by its owner, or by the dead owner's buddy) is
chosen (`choose_step`); the buddies send the newcomers their packs of T, and every
rank loads T (`restore`). A rank and its buddy dead at once leave a shard nowhere: T
is None and the caller loads the disk checkpoint. The state is copied raw: one flat uint8
buffer with the state's skeleton in front, as JSON (`_encode`): dicts, lists, tuples,
plain numbers, strings and the tensors' places. Nothing a peer sends is unpickled; a
skeleton that is not one `_encode` writes, or whose tensors fall outside the buffer, is
refused (`MalformedPack`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from disttrain.elastic.host_copy import HostCopy, host_buffer, on_cuda
from disttrain.runtime import fault_injection
from disttrain.runtime.collectives import all_gather_json
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

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


def _is_dtensor(x: Any) -> TypeGuard[DTensor]:
    return type(x).__name__ == "DTensor" and hasattr(x, "to_local")


class MalformedPack(ValueError):
    """A pack whose skeleton is not what `pack` writes: refused, never interpreted."""


def _skeleton(tree: Any, leaves: list[tuple[_Slot, torch.Tensor]], offset: list[int]) -> Any:
    """`tree` with each tensor replaced by a `_Slot`; (slot, local shard) pairs go to
    `leaves` in order."""
    if isinstance(tree, dict):
        return {k: _skeleton(v, leaves, offset) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_skeleton(v, leaves, offset) for v in tree)
    if isinstance(tree, torch.Tensor):
        sharded = _is_dtensor(tree)
        local = tree.to_local() if _is_dtensor(tree) else tree
        nbytes = local.numel() * local.element_size()
        slot = _Slot(offset[0], nbytes, local.dtype, tuple(local.shape), sharded)
        offset[0] += nbytes
        leaves.append((slot, local))
        return slot
    return tree


def _encode(tree: Any) -> Any:
    """A skeleton as JSON values that keep what JSON alone would lose (a dict's int
    keys, a tuple): each node is a one-key dict naming its kind. Raises `TypeError` for
    a value that only a pickle could carry."""
    if isinstance(tree, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"t" if isinstance(tree, tuple) else "l": [_encode(v) for v in tree]}
    if isinstance(tree, _Slot):
        dtype = str(tree.dtype).removeprefix("torch.")
        return {"s": [tree.offset, tree.nbytes, dtype, list(tree.shape), tree.dtensor]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"v": tree}
    raise TypeError(f"a {type(tree).__name__} in the state cannot be copied without pickle")


def _slot(fields: Any, size: int) -> _Slot:
    """The `_Slot` of a decoded skeleton; its bytes must lie within `size` and match
    its dtype and shape."""
    offset, nbytes, name, shape, dtensor = fields
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not all(type(d) is int and d >= 0 for d in (offset, nbytes, *shape)):
        raise MalformedPack(f"a tensor's place in the pack is not one a pack writes: {fields!r:.200}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if offset + nbytes > size or math.prod(shape) * itemsize != nbytes:
        raise MalformedPack(f"a tensor of the pack does not fit its bytes: {fields!r:.200}")
    return _Slot(offset, nbytes, dtype, tuple(shape), bool(dtensor))


def _decode(node: Any, size: int) -> Any:
    """The skeleton `_encode` wrote, its slots checked against a data part of `size`
    bytes. Raises `MalformedPack` for anything else."""
    if not isinstance(node, dict) or len(node) != 1:
        raise MalformedPack(f"a node of the pack's skeleton is not one a pack writes: {node!r:.200}")
    ((kind, body),) = node.items()
    if kind == "v" and (body is None or isinstance(body, (bool, int, float, str))):
        return body
    if kind in ("l", "t") and isinstance(body, list):
        items = [_decode(v, size) for v in body]
        return tuple(items) if kind == "t" else items
    if kind == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        pairs = [(_decode(k, size), _decode(v, size)) for k, v in body]
        if not all(k is None or isinstance(k, (bool, int, float, str)) for k, _ in pairs):
            raise MalformedPack("a key of the pack's skeleton is not a plain value")
        return dict(pairs)
    if kind == "s" and isinstance(body, list) and len(body) == 5:
        return _slot(body, size)
    raise MalformedPack(f"a node of the pack's skeleton is not one a pack writes: {node!r:.200}")


def pack(
    sd: dict, capacity: int | None = None, into: torch.Tensor | None = None, copier: HostCopy | None = None
) -> torch.Tensor:
    """`sd` (a nested state dict: `live_state`) as one flat uint8 CPU tensor of `capacity`
    bytes (None: exactly what it needs), written into `into` when it has that size
    (the buffer of an older pack, reused). Device tensors go through `copier` (a side
    stream into pinned memory, `elastic.host_copy`); the caller waits on it before the
    buffer is read (a fresh copier is waited here). Raises `OverflowError` when it does
    not fit, `TypeError` for a value that only a pickle could carry (`_encode`)."""
    leaves: list[tuple[_Slot, torch.Tensor]] = []
    offset = [0]
    skeleton = json.dumps(_encode(_skeleton(sd, leaves, offset)), separators=(",", ":")).encode()
    start = _HEADER + -(-len(skeleton) // 16) * 16
    need = start + offset[0]
    size = need if capacity is None else capacity
    if need > size:
        raise OverflowError(f"the state needs {need} bytes, the buffer holds {size}")
    device = on_cuda(local for _, local in leaves)
    buf = into if into is not None and into.numel() == size else host_buffer(size, pinned=device)
    buf[:8].view(torch.int64)[0] = len(skeleton)
    buf[_HEADER : _HEADER + len(skeleton)].copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    if leaves and not device:  # one copy kernel for every tensor, back to back
        torch.cat([local.detach().reshape(-1).view(torch.uint8) for _, local in leaves], out=buf[start:need])
    elif leaves:
        own = copier is None
        copier = copier or HostCopy()
        copier.copy(
            [
                (
                    buf[start + slot.offset : start + slot.offset + slot.nbytes],
                    local.detach().reshape(-1).view(torch.uint8),
                )
                for slot, local in leaves
            ]
        )
        if own:
            copier.wait()
    return buf


@dataclass(frozen=True)
class LocalPiece:
    """A DTensor leaf of a pack unpacked as its rank's local piece (`unpack(local=True)`)."""

    tensor: torch.Tensor


def unpack(buf: torch.Tensor, template: dict | None, local: bool = False) -> dict:
    """The state dict packed in `buf`, its tensors copied out of the buffer (on the
    CPU). A DTensor leaf takes its mesh and placements from the same place in
    `template` (`local`: it stays the packing rank's piece, a `LocalPiece`). Raises
    `KeyError` when the template has no DTensor there, and `MalformedPack` when `buf` is
    not a pack (`_decode`): a peer's bytes are parsed as JSON and checked, never
    unpickled."""
    n = int(buf[:8].view(torch.int64)[0]) if buf.numel() >= _HEADER else -1
    start = _HEADER + -(-n // 16) * 16
    if n < 0 or start > buf.numel():
        raise MalformedPack(f"the pack's skeleton claims {n} bytes of a {buf.numel()}-byte buffer")
    try:
        tree = json.loads(buf[_HEADER : _HEADER + n].numpy().tobytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedPack(f"the pack's skeleton is not JSON ({type(e).__name__})") from None
    data = buf[start:]
    return _fill(_decode(tree, data.numel()), data, template, local)


def _fill(tree: Any, data: torch.Tensor, template: Any, pieces: bool = False) -> Any:
    if isinstance(tree, dict):
        return {
            k: _fill(v, data, template[k] if isinstance(template, dict) and k in template else None, pieces)
            for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return type(tree)(
            _fill(v, data, template[i] if isinstance(template, (list, tuple)) and i < len(template) else None, pieces)
            for i, v in enumerate(tree)
        )
    if not isinstance(tree, _Slot):
        return tree
    # cloned first: a fresh, aligned storage that views as any dtype
    raw = data[tree.offset : tree.offset + tree.nbytes].clone()
    local = (raw.view(tree.dtype) if tree.nbytes else torch.empty(0, dtype=tree.dtype)).reshape(tree.shape)
    if not tree.dtensor:  # stays on the CPU: load_state_dict moves it where it belongs
        return local
    if pieces:
        return LocalPiece(local)
    if not _is_dtensor(template):
        raise KeyError("a sharded tensor of the buddy copy has no DTensor in this rank's state")
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(template.device),
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
        run_check=False,
    )


def live_state(state) -> dict:
    """The part of a `TrainState` a buddy pack holds, in the modules' own state-dict
    form: cheap (no DCP name mapping, nothing gathered; FSDP2 gives this rank's DTensor
    shards, aliases of the live tensors). The RNG is left out: the trainer reseeds at
    every step from (seed, step, rank) (`runtime.seed_step`)."""
    opt, meta = state.optimizer, {"step": state.step, "epoch": state.epoch}
    for name in ("scheduler", "sampler", "scaler"):
        obj = getattr(state, name)
        meta[name] = obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None
    return {"model": state.model.state_dict(), "optim": opt.state_dict() if opt is not None else None, "meta": meta}


def load_live_state(state, sd: dict) -> None:
    """Load what `live_state` took (strict: a missing or unexpected key raises)."""
    load_model_in_place(state.model, sd["model"])
    if state.optimizer is not None:
        state.optimizer.load_state_dict(sd["optim"])
    meta = sd["meta"]
    for name in ("scheduler", "sampler", "scaler"):
        obj = getattr(state, name)
        if obj is not None and meta[name] is not None:
            obj.load_state_dict(meta[name])
    state.step, state.epoch = int(meta["step"]), int(meta["epoch"])


def load_model_in_place(model: torch.nn.Module, sd: dict) -> None:
    """`model.load_state_dict(sd)`, with each tensor copied into the model's own local
    piece when every entry of `sd` is a tensor of the same place as the model's (a
    DTensor of the same mesh, placements and shape, or a plain tensor of the same shape);
    otherwise `load_state_dict` itself, which also says what does not match.

    Why: a DTensor `copy_` goes through DTensor's sharding propagation, which a process
    has not cached yet on its first recovery: 0.02-0.03 s for the small GPT on an idle
    host, 0.1-0.2 s with four ranks on two cores, while every peer waits. The local
    pieces are the same bytes that copy would write. `model.state_dict()` first puts an
    FSDP module's parameters in their sharded form (its state-dict hook), so the pieces
    written are the ones it trains."""
    live = model.state_dict()
    if live.keys() != sd.keys() or not all(_same_place(live[k], sd[k]) for k in live):
        model.load_state_dict(sd)
        return
    with torch.no_grad():
        for key, dst in live.items():
            src = sd[key]
            if _is_dtensor(dst):
                dst.to_local().copy_(src.to_local())
            else:
                dst.copy_(src)


def _same_place(dst: Any, src: Any) -> bool:
    if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)) or dst.shape != src.shape:
        return False
    if _is_dtensor(dst) != _is_dtensor(src):
        return False
    if not _is_dtensor(dst):
        return True
    assert _is_dtensor(src)
    return (
        dst.device_mesh == src.device_mesh
        and tuple(dst.placements) == tuple(src.placements)
        and dst.to_local().shape == src.to_local().shape
    )


class _AnyKey(dict):
    """A template whose every key holds `value`: an optimizer state entry's tensors have
    their parameter's mesh, placements and shape."""

    def __init__(self, value: Any):
        super().__init__()
        self.value = value

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: Any) -> Any:
        return self.value


def template_of(state) -> dict:
    """Where `unpack` finds each DTensor's mesh and placements on this rank (a newcomer's
    optimizer has no state yet: its parameters stand in)."""
    params = [p for g in state.optimizer.param_groups for p in g["params"]] if state.optimizer else []
    return {"model": state.model.state_dict(), "optim": {"state": {i: _AnyKey(p) for i, p in enumerate(params)}}}


def buddy_shift(world: int, local_world: int) -> int:
    """How far a rank's buddy is: rank r's pack goes to (r + shift) % world and it holds
    the pack of (r - shift) % world. On several nodes of `local_world` ranks each (torchrun
    numbers a node's ranks consecutively) the shift is `local_world`: the buddy is the
    rank with the same local rank on the next node, so a node's loss leaves each of its
    shards on another node. On one node (or ranks that do not fill equal nodes) it is 1."""
    if 0 < local_world < world and world % local_world == 0:
        return local_world
    return 1


def local_world_size(world: int) -> int:
    """The ranks per node torchrun gave this process (`LOCAL_WORLD_SIZE`; `world` when unset)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return world


def choose_step(offers: list[dict], shift: int = 1) -> int | None:
    """The newest step whose every shard is held: by its owner (`mine`), or, for a
    newcomer (an offer with `new` True), by the owner's buddy (`theirs` of rank
    (i + shift) % world, `buddy_shift`). None when no step is complete."""
    world = len(offers)
    candidates = {s for o in offers for s in (*o["mine"], *o["theirs"])}
    for step in sorted(candidates, reverse=True):
        if all(
            step
            in (
                o["mine"]
                if not o["new"]
                else (() if offers[(i + shift) % world]["new"] else offers[(i + shift) % world]["theirs"])
            )
            for i, o in enumerate(offers)
        ):
            return step
    return None


def resharded_words(before: int, world: int) -> str:
    """Why a generation after a shrink reads the disk under a sharded strategy."""
    return f"the world changed ({before} -> {world} ranks), so the shards are resharded from the newest disk checkpoint"


class BuddyCopy:
    """The packs of one rank; kept across the attempts of a fast recovery.

    `mine`: step -> this rank's own pack (the last two); `theirs`: step -> the pack of
    the rank whose buddy this one is (the newest complete one; after a failure also the
    one before, `salvage`). `attach(group)` binds the gloo group of the current
    generation."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.mine: dict[int, torch.Tensor] = {}
        self.theirs: dict[int, torch.Tensor] = {}
        self.group = None
        self.shift = 1
        self._capacity: list[int] | None = None
        self._pending: tuple[int, list, torch.Tensor] | None = None
        self._spare: torch.Tensor | None = None
        self.disabled = False
        self.copier = HostCopy()

    def attach(self, group) -> None:
        """A new generation's group: exchanges start over (capacities are gathered again)
        and the buddies are placed for its world (`buddy_shift`)."""
        self.group, self._capacity, self._pending = group, None, None
        world = dist.get_world_size(group)
        self.shift = buddy_shift(world, local_world_size(world))

    # ------------------------------------------------------------ every step
    def start(self, step: int, state, force: bool = False) -> None:
        """Pack this rank's committed `state` of `step` and post the exchange with the
        buddies, at steps that are multiples of `every` (any step with `force`); the
        previous exchange is waited first. A collective of the buddy group (call it at
        the same step on every rank)."""
        if self.disabled or self.group is None or (step % self.every and not force):
            return
        self.finish()
        sd = live_state(state)
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self._capacity is None:
            try:
                need = pack(sd).numel()
            except TypeError as e:  # the same state on every rank: each turns its copy off here
                self._off(rank, e)
                return
            mine_cap = need + need // 8 + 65536  # room for a skeleton that grows a little
            self._capacity = [int(c) for c in all_gather_json(mine_cap, group=self.group)]
        oldest = min(self.mine) if len(self.mine) >= 2 else None
        try:  # the oldest pack's buffer is reused: nothing sends it any more (waited above)
            buf = pack(
                sd, self._capacity[rank], into=self.mine.pop(oldest) if oldest is not None else None, copier=self.copier
            )
        except (OverflowError, TypeError) as e:  # every later copy would fail too
            self._off(rank, e)
            return
        self.mine[step] = buf
        size = self._capacity[(rank - self.shift) % world]
        spare, self._spare = self._spare, None
        incoming = spare if spare is not None and spare.numel() == size else torch.empty(size, dtype=torch.uint8)
        self.copier.wait()  # on CUDA: the side stream's copy is in the buffer before gloo reads it
        # The group spans the whole world in rank order: its ranks are the global ones.
        works = [
            dist.isend(buf, dst=(rank + self.shift) % world, group=self.group),
            dist.irecv(incoming, src=(rank - self.shift) % world, group=self.group),
        ]
        self._pending = (step, works, incoming)
        fault_injection.inject("buddy", step, dist.get_rank())

    def _off(self, rank: int, why: Exception) -> None:
        """Turn the copy off for the run; the disk checkpoint remains."""
        self.disabled = True
        LOGGER.warning(f"{speaker()}: rank {rank}: the buddy copy is off for this run ({why})", extra=EVERY_RANK)

    def finish(self) -> None:
        """Wait for the exchange in flight; the received pack becomes `theirs`."""
        if self._pending is None:
            return
        step, works, incoming = self._pending
        self._pending = None
        for w in works:
            w.wait()
        self._spare = next(iter(self.theirs.values()), None)  # the next receive goes there
        self.theirs = {step: incoming}

    def salvage(self) -> None:
        """After a failure: keep the received pack in flight if it had arrived in full,
        beside the older one (never wait on the dead group). Both are kept because a
        node's loss cuts its ranks' sends at different points: one buddy may hold its
        source's pack of step T while another holds only T - 1, and T - 1 is then the
        newest step held for every shard (`choose_step`), where the newer pack alone
        would leave none and the disk checkpoint would be read."""
        pending, self._pending, self.group = self._pending, None, None  # the group is destroyed next
        if pending is None:
            return
        step, works, incoming = pending
        try:  # gloo marks a receive complete only in wait(): a short one, never a hang
            works[1].wait(datetime.timedelta(milliseconds=SALVAGE_WAIT_MS))
            self.theirs[step] = incoming  # (a buffer apart: `start` receives into the spare)
        except Exception:  # noqa: BLE001 (the receive failed or did not finish: the older copy stays)
            pass

    # ------------------------------------------------------------ recovery
    def held_by_rank(self, rank: int, world: int) -> dict[int, dict[int, torch.Tensor]]:
        """The packs this rank holds, by the rank they belong to in a world of `world`
        where this one was `rank`: its own, and its source's (`buddy_reshard`)."""
        held = {rank: dict(self.mine)}
        if self.theirs:
            held[(rank - self.shift) % world] = dict(self.theirs)
        return held

    def offer(self, newcomer: bool, from_world: int = 0) -> dict:
        return {
            "new": newcomer,
            "from": from_world,
            "mine": sorted(self.mine),
            "theirs": sorted(self.theirs),
            "sizes": [[s, b.numel()] for s, b in self.theirs.items()],  # JSON: no int keys
        }

    def restore(self, state, newcomer: bool, gen: int, from_world: int = 0) -> bool:
        """A collective of the new generation (default group and buddy group): load the
        newest step every shard is held for into `state`. False when there is none
        (the caller loads the disk checkpoint). `from_world`: the world this rank's
        copies were dropped from because the job shrank (0: none), for the line that
        says why the disk checkpoint is read."""
        rank, world = dist.get_rank(), dist.get_world_size()
        offers: list[dict] = all_gather_json(self.offer(newcomer, from_world))
        step = choose_step(offers, self.shift)
        fault_injection.inject("recovery", -1 if step is None else step, rank)
        if step is None:
            shrunk_from = max(int(o.get("from", 0)) for o in offers)
            why = (
                resharded_words(shrunk_from, world)
                if shrunk_from
                else "no step has every shard in memory; loading the newest checkpoint"
            )
            LOGGER.info(f"{speaker()}: generation {gen}: {why}")
            return False
        left, right = (rank - self.shift) % world, (rank + self.shift) % world
        works = []
        if offers[left]["new"]:  # this rank holds the dead source's shard
            works.append(dist.isend(self.theirs[step], dst=left, group=self.group))
        if newcomer:
            buf = torch.empty(int(dict(offers[right]["sizes"])[step]), dtype=torch.uint8)
            works.append(dist.irecv(buf, src=right, group=self.group))
        for w in works:
            if w is not None:  # (None only for a rank outside the group)
                w.wait()
        own = buf if newcomer else self.mine[step]
        load_live_state(state, unpack(own, template_of(state)))
        self.mine = {step: own}
        self.theirs = {}
        newcomers = [i for i, o in enumerate(offers) if o["new"]]
        holders = [(i + self.shift) % world for i in newcomers]
        LOGGER.info(
            f"{speaker()}: generation {gen}: step {step} restored from memory "
            f"(shards of ranks {newcomers} from their buddies); the buddies: ranks {holders}"
        )
        return True
