"""`Layout`: the one validated object that owns the world layout and its DeviceMesh
(P-INIT-7, P-FSDP-4).

Every data-parallel strategy is a replicate x shard grid over the ranks:

    ddp / zero1 / dp     replicate = world, shard = 1   (no mesh needed)
    fsdp full, grad_op   replicate = 1,     shard = world
    fsdp hybrid (HSDP)   replicate = world / g, shard = g   (g = shard_group_size)
    fsdp none            replicate = world, shard = 1

Rank r sits at row r // shard, column r % shard, so a shard group is a block of
consecutive ranks: on a real cluster, the GPUs of one node.

With tensor parallelism (`tp` > 1) the grid gains a third, innermost dimension: the
mesh is (replicate, shard, tp) over replicate x shard x tp ranks, a TP group is `tp`
consecutive ranks, and the grid above spans the data-parallel ranks (rank // tp). disttrain builds the
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

REPLICATE, SHARD, TP = "replicate", "shard", "tp"

# Meshes already built in this process group, so that wrapping several models (tests,
# evaluation copies) reuses their sub-groups instead of creating new ones each time.
# Keyed weakly by the default group object: a new process group never matches, and a
# destroyed one is not kept alive here (a gloo group closes its connections only when
# it is destructed, which an in-memory recovery relies on).
_meshes: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Layout:
    """A replicate x shard (x tp) grid of `world_size` ranks on `device_type` devices.

    Data-parallel rank d = r // tp sits in replica `d // shard`; the ranks of one replica
    shard the model among themselves (FSDP), the replicas hold copies (HSDP when both
    exceed 1); the `tp` consecutive ranks of one TP group split each layer.
    `Layout.for_strategy` derives it from a strategy, a sharding mode, the world and
    the TP degree; `build_mesh()` and `tp_mesh()` make torch's `DeviceMesh`es from it
    (collectives). A grid that does not cover the world (replicate x shard x tp !=
    world_size, or a size below 1) is a `ConfigError` at construction.
    """

    world_size: int
    replicate: int
    shard: int
    device_type: str = "cpu"
    tp: int = 1

    def __post_init__(self):
        sizes = (self.replicate, self.shard, self.tp)
        if self.replicate * self.shard * self.tp != self.world_size or min(sizes) < 1:
            raise ConfigError(
                f"layout {self.replicate} replicas x {self.shard} shards x tp {self.tp} does not "
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
        tp: int = 1,
    ) -> Layout:
        """The grid for a strategy and sharding mode, over the world / tp data-parallel ranks.

        `shard_group_size=0` means one node's data-parallel ranks (`local_world_size`
        / tp), the usual HSDP layout. Raises `ConfigError` when the group size does not
        divide the data-parallel world, naming the sizes that would.
        """
        local = None if local_world_size is None else max(1, local_world_size // tp)
        replicate, shard = shard_grid(
            strategy, sharding, world_size // tp, shard_group_size=shard_group_size, local_world_size=local
        )
        return cls(world_size, replicate, shard, device_type, tp)

    @property
    def is_hybrid(self) -> bool:
        """More than one replica and more than one shard: HSDP."""
        return self.replicate > 1 and self.shard > 1

    def replica_of(self, rank: int) -> int:
        """Which replica (row) `rank` belongs to."""
        return rank // self.tp // self.shard

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world over the TP degree."""
        return self.replicate * self.shard

    def build_mesh(self) -> DeviceMesh:
        """The data-parallel mesh: 1D ('shard',) when there is one replica, else 2D
        ('replicate', 'shard'); with tp > 1, that slice of the 3D (replicate, shard, tp)
        mesh.

        A collective the first time for a given grid (every rank calls it in the same
        order); later calls in the same process group return the same mesh. Needs a
        started process group.
        """
        if self.tp > 1:
            full = self._full_mesh()
            return full[SHARD] if self.replicate == 1 else full[REPLICATE, SHARD]
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

    def tp_mesh(self) -> DeviceMesh:
        """The 1D ('tp',) mesh of this rank's TP group (a collective the first time, as
        `build_mesh`)."""
        return self._full_mesh()[TP]

    def _full_mesh(self) -> DeviceMesh:
        world = dist.group.WORLD
        assert world is not None, "DeviceMesh needs a started process group"
        built = _meshes.setdefault(world, {})
        key = (self.device_type, self.replicate, self.shard, self.tp)
        if key not in built:
            built[key] = init_device_mesh(
                self.device_type, (self.replicate, self.shard, self.tp), mesh_dim_names=(REPLICATE, SHARD, TP)
            )
        return built[key]
