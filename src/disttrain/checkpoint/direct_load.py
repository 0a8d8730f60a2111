"""A `raw-1` load without DCP's planner where DCP's plan is known without planning.

DCP's default load planner makes one read item per overlap of a target tensor with a
saved chunk (`create_default_local_load_plan`). When every target is a plain tensor
(not a DTensor, not on the meta device) of its saved shape and the checkpoint holds
each as one whole chunk (a DDP or single-process save, loaded by DDP or a single
process at any world size), that is one item per tensor: the whole target from the
whole chunk, and one item per non-tensor value. `direct_plan` builds exactly those
items (none for a tensor with a zero-sized dimension, as DCP's overlap test gives
none), `DirectPlanner` resolves them the way `JsonLoadPlanner` does, and
`RawReader.read_data` reads them. The flattening and the plan then cost one pass
over the keys instead of DCP's traversals and overlap sweeps.

Any other case (FSDP's shards, a checkpoint of another layout, keys on one side
only) gets None: the caller loads through DCP's planner, which reshards.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from disttrain.checkpoint.json_records import set_path, value_of


def direct_plan(flat: dict, metadata) -> LoadPlan | None:
    """The load plan DCP's default planner would make for the flattened targets
    `flat` (DCP's keys) from `metadata`, or None when it is not one whole read per
    key (see the module docstring). The checkpoint must hold exactly `flat`'s keys."""
    saved = metadata.state_dict_metadata
    if len(saved) != len(flat):
        return None
    items = []
    for fqn, obj in flat.items():
        md = saved.get(fqn)
        if isinstance(md, BytesStorageMetadata) and not isinstance(obj, torch.Tensor):
            zero = torch.Size((0,))
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=MetadataIndex(fqn),
                    dest_offsets=zero,
                    storage_index=MetadataIndex(fqn),
                    storage_offsets=zero,
                    lengths=zero,
                )
            )
            continue
        if (
            not isinstance(md, TensorStorageMetadata)
            or type(obj) is not torch.Tensor
            or obj.device.type == "meta"
            or md.size != obj.size()
            or len(md.chunks) != 1
        ):
            return None
        chunk = md.chunks[0]
        if any(chunk.offsets) or chunk.sizes != md.size:
            return None
        if 0 in obj.size():
            continue  # DCP's overlap test reads nothing into an empty tensor
        origin = torch.Size([0] * obj.dim())
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, origin, 0),
                dest_offsets=origin,
                storage_index=MetadataIndex(fqn, chunk.offsets, 0),
                storage_offsets=origin,
                lengths=obj.size(),
            )
        )
    return LoadPlan(items)


class DirectPlanner:
    """What `RawReader.read_data` asks of a planner, for a `direct_plan`: each tensor
    item's target is the whole flattened tensor; each value is parsed from JSON and
    put at its key's path in the nested `state` (DCP's `load_bytes` with
    `JsonLoadPlanner`'s parsing)."""

    def __init__(self, state: dict, flat: dict, paths: dict):
        self.state, self.flat, self.paths = state, flat, paths

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.flat[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read in place, as DCP's default planner leaves it

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        set_path(self.state, self.paths[item.dest_index.fqn], value_of(value.getvalue()))
