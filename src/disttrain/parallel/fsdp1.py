"""Legacy FSDP1 (`FullyShardedDataParallel`, flat parameters) for users with FSDP1
code (P-FSDP-9). New code should use `fsdp` (FSDP2): it has no flat parameters,
runs every option on CPU and is where PyTorch development happens.

disttrain's FSDP1 is always built with:
- `use_orig_params=True` (P-FSDP-7): per-parameter optimizer groups and PEFT work;
- `device_id` set to this rank's device (FSDP1 needs `torch.device("cpu")` on CPU);
- a DeviceMesh that disttrain builds for HYBRID_SHARD. Without one, HYBRID_SHARD at
  w=2 on torch 2.13 silently stops syncing gradients across replicas (only a
  warning is printed) and the replicas diverge.

Known FSDP1 limits on CPU are refused by `check_fsdp1` with a message that points
to `fsdp`, before anything is built.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from disttrain.config import check_fsdp1
from disttrain.parallel.blocks import apply_activation_checkpointing, check_tied_weights, find_blocks
from disttrain.parallel.mesh import Layout
from disttrain.runtime import torch_compat

STRATEGY_NAMES = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
    "none": ShardingStrategy.NO_SHARD,
}


def apply_fsdp1(
    model: nn.Module,
    layout: Layout,
    device: torch.device,
    *,
    sharding: str = "full",
    wrap: str = "auto",
    precision: str = "fp32",
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
) -> FullyShardedDataParallel:
    """Wrap `model` in FSDP1 with one unit per block and return the wrapper.

    A collective: every rank calls it with the same arguments. Raises `ConfigError`
    for the FSDP1 limits above and for a wrap plan that splits tied weights.
    """
    check_fsdp1(precision=precision, cpu_offload=cpu_offload, device_type=device.type)
    blocks = find_blocks(model, wrap)
    check_tied_weights(model, blocks)
    if activation_checkpointing:
        blocks = apply_activation_checkpointing(model, blocks)
    classes = {type(b) for b in blocks}
    mixed = None
    if precision == "bf16":
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    mesh = None
    if sharding == "hybrid":
        # Always pass the mesh: rows replicate, columns shard (see the module docstring).
        mesh = layout.build_mesh() if layout.is_hybrid else None
    strategy = STRATEGY_NAMES[sharding]
    if sharding == "hybrid" and not layout.is_hybrid:
        # A degenerate grid is one of the plain strategies; HYBRID_SHARD needs two real dims.
        strategy = ShardingStrategy.FULL_SHARD if layout.replicate == 1 else ShardingStrategy.NO_SHARD
    if activation_checkpointing:
        classes = {torch_compat.checkpoint_wrapper_class()}
    return FullyShardedDataParallel(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy(classes) if classes else None,
        mixed_precision=mixed,
        device_id=device,
        use_orig_params=True,
        device_mesh=mesh,
    )
