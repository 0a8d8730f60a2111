"""`Layout`: the one validated object that owns the world layout and its DeviceMesh
(P-INIT-7, P-FSDP-4).

Every data-parallel strategy is a replicate x shard grid over the ranks:

    ddp / zero1 / dp     replicate = world, shard = 1   (no mesh needed)
    fsdp full, grad_op   replicate = 1,     shard = world
    fsdp hybrid (HSDP)   replicate = world / g, shard = g   (g = shard_group_size)
    fsdp none            replicate = world, shard = 1

Rank r sits at row r // shard, column r % shard, so a shard group is a block of
consecutive ranks: on a real cluster, the GPUs of one node. disttrain builds the
mesh itself so that FSDP1 HYBRID_SHARD never runs without one (without a mesh it
silently stops syncing gradients across replicas at w=2 on torch 2.13).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.config import shard_grid
from disttrain.errors import ConfigError

REPLICATE, SHARD = "replicate", "shard"

# Meshes already built in this process group, so that wrapping several models (tests,
# evaluation copies) reuses their sub-groups instead of creating new ones each time.
# Keyed weakly by the default group object: a new process group never matches, and a
# destroyed one is not kept alive here (a gloo group closes its connections only when
# it is destructed, which an in-memory recovery relies on).
_meshes: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Layout:
    """A replicate x shard grid of `world_size` ranks on `device_type` devices.

    Rank r sits in replica `r // shard`; the ranks of one replica shard the model
    among themselves (FSDP), the replicas hold copies (HSDP when both exceed 1).
    `Layout.for_strategy` derives it from a strategy, a sharding mode and the world;
    `build_mesh()` makes torch's `DeviceMesh` from it (a collective). A grid that does
    not cover the world (replicate x shard != world_size, or a size below 1) is a
    `ConfigError` at construction.
    """

    world_size: int
    replicate: int
    shard: int
    device_type: str = "cpu"

    def __post_init__(self):
        if self.replicate * self.shard != self.world_size or min(self.replicate, self.shard) < 1:
            raise ConfigError(
                f"layout {self.replicate} replicas x {self.shard} shards does not "
                f"cover a world of {self.world_size} ranks."
            )

    @classmethod
    def for_strategy(
        cls,
        strategy: str,
        sharding: str,
        world_size: int,
        *,
        shard_group_size: int = 0,
        local_world_size: int | None = None,
        device_type: str = "cpu",
    ) -> Layout:
        """The grid for a strategy and sharding mode.

        `shard_group_size=0` means one node's processes (`local_world_size`), the
        usual HSDP layout. Raises `ConfigError` when the group size does not divide
        the world, naming the sizes that would.
        """
        replicate, shard = shard_grid(
            strategy, sharding, world_size, shard_group_size=shard_group_size, local_world_size=local_world_size
        )
        return cls(world_size, replicate, shard, device_type)

    @property
    def is_hybrid(self) -> bool:
        """More than one replica and more than one shard: HSDP."""
        return self.replicate > 1 and self.shard > 1

    def replica_of(self, rank: int) -> int:
        """Which replica (row) `rank` belongs to."""
        return rank // self.shard

    def build_mesh(self) -> DeviceMesh:
        """A 1D mesh ('shard',) when there is one replica, else 2D ('replicate', 'shard').

        A collective the first time for a given grid (every rank calls it in the same
        order); later calls in the same process group return the same mesh. Needs a
        started process group.
        """
        world = dist.group.WORLD
        assert world is not None, "DeviceMesh needs a started process group"
        built = _meshes.setdefault(world, {})
        key = (self.device_type, self.replicate, self.shard)
        if key not in built:
            if self.replicate == 1:
                built[key] = init_device_mesh(self.device_type, (self.shard,), mesh_dim_names=(SHARD,))
            else:
                built[key] = init_device_mesh(
                    self.device_type, (self.replicate, self.shard), mesh_dim_names=(REPLICATE, SHARD)
                )
        return built[key]
