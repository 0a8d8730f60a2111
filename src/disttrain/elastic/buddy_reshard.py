"""After a shrink under FSDP, the shards of the smaller world built from the buddy copies
the survivors hold in memory, instead of the disk checkpoint (docs/elastic.md).

Before the shrink each rank held its own packs (`BuddyCopy.mine`) and the newest pack of
the rank whose buddy it was (`theirs`): a lost node's shards are on survivors
(`buddy_copy.buddy_shift` puts each buddy on another node). In the shrunk generation
(`reshard`, a collective of every member):
1. every rank offers the old ranks and steps it holds a pack of; the newest step held for
   every old rank is chosen (none: False, and the caller reads the disk as before);
2. for each old rank, the lowest new rank that holds its pack broadcasts it, so every
   rank has the whole old state (a full copy in CPU memory per rank, for the moment of
   the reshard);
3. each FSDP-sharded tensor is put back whole (the old ranks' pieces in order along
   dim 0) and this rank keeps its piece of the new world, the rows FSDP2 gives it
   (`torch.chunk` over the new world), or the whole tensor at world 1 (not sharded
   there); the rest (replicated values, the LR schedule, the sampler) is the old rank 0's.
Only one-dimensional FSDP (`Shard(0)` on a one-dimensional mesh) is resharded here; a
2D (tensor-parallel) layout, a pack that is not one `pack` writes, or a piece whose
rows do not match return False (the disk checkpoint, resharded by DCP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disttrain.elastic.buddy_copy import LocalPiece, MalformedPack, load_live_state, template_of, unpack
from disttrain.runtime.collectives import all_gather_json, broadcast_bytes
from disttrain.runtime.log import LOGGER, speaker


class NotReshardable(ValueError):
    """A layout or a piece this module does not rebuild: the disk checkpoint instead."""


def choose(offers: list[dict], old_world: int) -> tuple[int, list[int]] | None:
    """The newest step held for every old rank, and for each old rank the lowest new rank
    that holds it; None when no step is held for all. `offers[i]`: {old rank (str): steps}."""
    steps = {s for o in offers for held in o.values() for s in held}
    for step in sorted(steps, reverse=True):
        holders = [next((i for i, o in enumerate(offers) if step in o.get(str(r), ())), -1) for r in range(old_world)]
        if -1 not in holders:
            return step, holders
    return None


def _gather_packs(mine: dict[int, torch.Tensor], holders: list[int]) -> list[torch.Tensor]:
    """Every old rank's pack on every rank: each from its holder, by broadcast."""
    rank = dist.get_rank()
    return [broadcast_bytes(mine[old] if rank == src else None, src) for old, src in enumerate(holders)]


def _piece(template: Any, pieces: list[torch.Tensor]) -> Any:
    """This rank's DTensor of the new world for `template`, from the old ranks' `pieces`."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = template.device_mesh, tuple(template.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise NotReshardable(f"a layout other than FSDP's Shard(0) on one mesh dimension: {placements}")
    whole = torch.cat(pieces, dim=0)
    if tuple(whole.shape) != tuple(template.shape):
        raise NotReshardable(f"pieces of shape {tuple(whole.shape)} for a tensor of {tuple(template.shape)}")
    chunks = torch.chunk(whole, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    local = chunks[rank] if rank < len(chunks) else whole[:0]
    if tuple(local.shape) != tuple(template.to_local().shape):
        raise NotReshardable("this rank's rows differ from FSDP's")
    return DTensor.from_local(
        local.contiguous().to(template.device),
        mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
        run_check=False,
    )


def _rebuild(trees: list[Any], template: Any) -> Any:
    """The new rank's state from the old ranks' unpacked `trees` (pieces as plain tensors)."""
    first = trees[0]
    if isinstance(first, dict):
        sub = lambda k: template[k] if isinstance(template, dict) and k in template else None  # noqa: E731
        return {k: _rebuild([t[k] for t in trees], sub(k)) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(
            _rebuild([t[i] for t in trees], template[i] if isinstance(template, (list, tuple)) else None)
            for i in range(len(first))
        )
    if isinstance(first, LocalPiece):
        pieces = [t.tensor for t in trees]
        if type(template).__name__ == "DTensor":
            return _piece(template, pieces)
        whole = torch.cat(pieces, dim=0)  # a world of one: the model is not sharded there
        if not isinstance(template, torch.Tensor) or tuple(whole.shape) != tuple(template.shape):
            raise NotReshardable("a sharded tensor of the buddy copy has no place in this rank's state")
        return whole
    return first  # replicated: the same on every old rank


def reshard(state, held: dict[int, dict[int, torch.Tensor]], old_world: int, gen: int) -> bool:
    """Load into `state` (a `TrainState` of the new, smaller world) the newest step every
    old rank's pack is held for in memory: `held` maps old rank -> {step: pack} on this
    rank. A collective of the new generation. False (nothing loaded) when no step is held
    for every old rank or the layout is not one this module rebuilds."""
    offers = all_gather_json({str(r): sorted(steps) for r, steps in held.items()})
    chosen = choose(offers, old_world)
    if chosen is None:
        return False
    step, holders = chosen
    packs = _gather_packs({r: steps[step] for r, steps in held.items() if step in steps}, holders)
    why = ""
    try:
        new = _rebuild([unpack(p, None, local=True) for p in packs], template_of(state))
    except (NotReshardable, MalformedPack, KeyError) as e:
        why = str(e) or type(e).__name__
    refused = [w for w in all_gather_json(why) if w]  # one rank's refusal is every rank's: all read the disk
    if refused:
        LOGGER.info(f"{speaker()}: generation {gen}: the buddy copies are not resharded here ({refused[0]})")
        return False
    load_live_state(state, new)
    world = dist.get_world_size()
    change = f"changed ({old_world} -> {world} ranks)" if world != old_world else f"is {world} ranks again"
    LOGGER.info(
        f"{speaker()}: generation {gen}: the world {change}; step {step} resharded from the buddy copies in memory"
    )
    return True
