"""Tensor parallel x FSDP: memory and communication per device for each TP degree.

A layout is tp x dp = world: the model's TP plan (`tp_count`) splits each planned
layer over the tp ranks of a group, and FSDP full shards what each rank then holds
over the dp data-parallel ranks (dt.wrap's order). Per device:

* **params, grads, optimizer state**: the parameters' TP-local shapes (a split
  dimension divided by tp; the rest, embeddings, norms and row-split biases, whole)
  laid out by `memory.fsdp_layout` over dp ranks, exactly as `memory` does for FSDP.
  A bare parameter count assumes its blocks are split and its embeddings are not.
* **activations**: of the 9 h + 2 f (GELU) or 9 h + 4 f (SwiGLU) values per token a
  block saves, TP divides those inside the split layers, q, k, v, the attention output
  and its contiguous copy (5 h) and the MLP's hidden ones (2 f or 4 f); the norms'
  inputs and outputs (4 h, the first being the block input) stay whole, as do the LM
  head's logits (our plans leave the output layer whole): 4 h + (5 h + 2 f) / tp per
  token and block.
* **buffers**: FSDP's, on the TP-local shapes (`memory`).

Communication per optimizer step and device, on top of FSDP's over the dp ranks (on
the TP-local shapes): a row-split layer's output is a partial sum, all-reduced in
forward; a column-split layer's input gradient is one too, all-reduced in backward.
Each moves tokens x width values in the compute dtype, 2 (tp - 1) / tp of them per
rank (ring), every micro-step. Megatron's fused layout (qkv, MLP) makes that 2 per block
forward and 2 backward; the built-in GPT's separate q, k and v make it 2 and 4, Llama's
(q, k, v, gate, up) 2 and 5: what torch's `ColwiseParallel` does, counted with
`CommDebugMode` (bench/tp_bench.py).

The planner recommends the smallest degree that fits with headroom (`planner`): TP's
collectives sit on the critical path of every layer, so fewer is faster whenever
memory allows.
"""

from __future__ import annotations

import dataclasses
import math

from disttrain.plan.comm import Comm, communication
from disttrain.plan.memory import Memory, Variant, Workload, memory
from disttrain.plan.model_size import ModelSpec

TP_VARIANT = Variant("fsdp_full")
"""The data-parallel side of every TP row: FSDP full over the dp ranks."""


def tp_degrees(spec: ModelSpec, world: int, per_node: int) -> list[int]:
    """Degrees that divide the devices of a node (and so the world), the heads, and every
    planned layer's split width into whole heads; [] when the model has no plan."""
    if not spec.tp_linears:
        return []
    head_dim = spec.hidden // spec.n_head
    good = []
    for tp in range(1, per_node + 1):
        if per_node % tp or world % tp or spec.n_head % tp:
            continue
        widths = [(o if s == "colwise" else i) for s, i, o in spec.tp_linears]
        if all(w % tp == 0 for w in widths) and all(
            (o // tp) % head_dim == 0 for s, i, o in spec.tp_linears if s == "colwise" and o <= spec.hidden
        ):
            good.append(tp)
    return good


def local_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """`spec` as one rank of a TP group holds it: split dimensions divided by `tp`."""
    if tp == 1:
        return spec
    if spec.param_shapes is None or not spec.tp_dims:
        split = sum(i * o for _, i, o in spec.tp_linears)  # weights only: biases are few
        per_block = split // max(1, spec.n_layer)
        return dataclasses.replace(
            spec,
            n_params=spec.n_params - split + split // tp,
            block_params=spec.block_params - per_block + per_block // tp,
        )
    shapes = []
    for shape, dim in zip(spec.param_shapes, spec.tp_dims, strict=True):
        shapes.append(shape if dim is None else tuple(n // tp if d == dim else n for d, n in enumerate(shape)))
    whole = [math.prod(s) for s, d in zip(spec.param_shapes, spec.tp_dims, strict=True) if d is not None]
    split_per_block = sum(whole) // max(1, spec.n_layer)
    return dataclasses.replace(
        spec,
        param_shapes=shapes,
        n_params=sum(math.prod(s) for s in shapes),
        block_params=spec.block_params - split_per_block + split_per_block // tp,
    )


def tp_memory(spec: ModelSpec, work: Workload, tp: int, dp: int) -> Memory:
    """Per-device bytes at tp x dp, FSDP full over the dp ranks (module docstring)."""
    return memory(local_spec(spec, tp), work, dp, TP_VARIANT, tp)


def tp_communication(spec: ModelSpec, work: Workload, tp: int, dp: int) -> Comm:
    """Bytes each device sends per optimizer step: TP's activation all-reduces inside
    its group, then FSDP's collectives over the dp ranks."""
    fsdp = communication(local_spec(spec, tp), work, dp, TP_VARIANT)
    parts: dict[str, int] = {}
    if tp > 1:
        tokens = work.batch_per_device * work.seq_len * work.accum_steps
        ring = 2 * (tp - 1) / tp
        per_layer = max(1, spec.n_layer)
        for style, phase in (("rowwise", "fwd"), ("colwise", "bwd")):
            # a row split's output (its out features), a column split's input gradient (in)
            widths = [o if style == "rowwise" else i for s, i, o in spec.tp_linears if s == style]
            n = -(-len(widths) // per_layer)
            parts[f"tp all-reduce {phase} x{n}/block"] = round(ring * tokens * sum(widths) * work.compute_bytes)
    parts.update({f"dp {k}": v for k, v in fsdp.parts.items()})
    return Comm(total=sum(parts.values()), parts=parts, host_transfer=fsdp.host_transfer)


def tp_traffic(comm_parts: dict[str, int]) -> tuple[int, int]:
    """(TP bytes inside a group, FSDP bytes over the dp ranks) of a TP row's parts."""
    tp = sum(v for k, v in comm_parts.items() if k.startswith("tp "))
    return tp, sum(comm_parts.values()) - tp
