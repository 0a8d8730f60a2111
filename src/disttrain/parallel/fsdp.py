"""FSDP2 (`fully_shard`, DTensor parameters) per block, then the root (P-FSDP-2..7).

Order, as in torchtitan: activation checkpointing wraps each block first, then
each block is compiled (`compile=True`, `compile.compile_blocks`), then
each block is sharded bottom-up, then the root takes every parameter left over
(embeddings, final norm, the tied LM head). Each block is one communication unit:
one all-gather before its forward and one reduce-scatter of its gradients.

Sharding modes map to `reshard_after_forward` and the mesh (see `mesh.Layout`):

    full     ZeRO-3 / FULL_SHARD      1D mesh, reshard after forward
    grad_op  ZeRO-2 / SHARD_GRAD_OP   1D mesh, keep parameters until backward
    hybrid   HSDP / HYBRID_SHARD      2D mesh: shard in a group, replicate across
    none     NO_SHARD                 2D mesh with shard groups of one rank

Parameters become DTensors: build the optimizer after `apply_fsdp` (P-FSDP-7),
clip with `loop.clip_grad_norm` (global norm across shards, P-LOOP-5).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from disttrain.parallel.blocks import apply_activation_checkpointing, check_tied_weights, find_blocks
from disttrain.parallel.compile import compile_blocks

# Whether parameters stay gathered between forward and backward.
_RESHARD_AFTER_FORWARD = {"full": True, "grad_op": False, "hybrid": True, "none": False}

_PARAM_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision_policy(precision: str, *, root: bool = False) -> MixedPrecisionPolicy:
    """P-FSDP-5: low-precision parameters for compute, fp32 gradient reduction.

    Only the root casts its output back to fp32, so a loss computed outside the model
    is accurate, while blocks hand low-precision activations to each other.
    """
    dtype = _PARAM_DTYPE[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
    )


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """P-FSDP-6: parameters, gradients and optimizer state on the CPU; the optimizer
    steps there. Pinned memory needs an accelerator, so it is off on a CPU job."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    sharding: str = "full",
    wrap: str = "auto",
    precision: str = "fp32",
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    compile: bool | dict = False,
) -> nn.Module:
    """Shard `model` in place with FSDP2 on `mesh` and return it.

    `wrap` chooses the units (`blocks.find_blocks`): 'auto' per block from
    `_no_split_modules`, class names, or 'model'. Tied weights must sit in one unit:
    a plan that splits them raises `ConfigError`. The returned module is the same
    object, now an `FSDPModule` with `set_requires_gradient_sync` (used by
    `loop.no_sync`). `compile` (True, or a dict of torch.compile options) compiles
    each block (or the whole model when there are none) after checkpointing and
    before sharding (`compile.compile_blocks`). A
    collective: every rank must call it with the same arguments.
    """
    blocks = find_blocks(model, wrap)
    check_tied_weights(model, blocks)
    if activation_checkpointing:
        blocks = apply_activation_checkpointing(model, blocks)
    if compile:
        compile_blocks(model, blocks, **(compile if isinstance(compile, dict) else {}))
    reshard = _RESHARD_AFTER_FORWARD[sharding]
    offload = offload_policy(cpu_offload, mesh.device_type)
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=mixed_precision_policy(precision),
            offload_policy=offload,
        )
    # The root's parameters are needed first in backward: keeping them gathered after
    # forward saves one all-gather at no real memory cost (what FSDP2 picks by default).
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False if blocks else reshard,
        mp_policy=mixed_precision_policy(precision, root=True),
        offload_policy=offload,
    )
    return model


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for `tensor`: its local shard for a DTensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full value, by name (a collective for DTensors).

    For tests and export; it materialises the whole model on every rank.
    """
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = value.detach()
    return out
