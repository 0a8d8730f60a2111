"""Bytes each device sends per optimizer step, per strategy (ring collectives).

With N ranks and a tensor of B bytes, a ring all-reduce moves 2(N-1)/N x B per rank,
an all-gather or a reduce-scatter (N-1)/N x B (B being the full, unsharded size); the
cost hardly depends on N, which is why DDP scales (P-DDP-2). Per optimizer step:

* DDP: one all-reduce of the fp32 gradients. With gradient accumulation the non-final
  micro-steps run under `no_sync`, so still one (P-DDP-5).
* ZeRO-1: the same all-reduce, then every rank receives the parameters it does not own
  after the sharded step (ZeroRedundancyOptimizer broadcasts them; an all-gather's worth).
* FSDP full (ZeRO-3): an all-gather of the parameters before each unit's forward and
  again before its backward, then a reduce-scatter of the gradients: 1.5x DDP in fp32
  (P-FSDP-2). The all-gathers repeat every micro-step; the reduce-scatter runs once per
  optimizer step when accumulation skips gradient sync on the other micro-steps.
* FSDP grad_op (ZeRO-2): parameters stay gathered from forward to backward, so one
  all-gather per micro-step plus the reduce-scatter: about DDP's volume.

All-gathers move parameters in the compute dtype (bf16 under mixed precision); gradient
reductions are fp32 (P-FSDP-5, and DDP reduces the fp32 `.grad`). FSDP sizes include the
dim-0 padding. CPU offload adds host<->device copies (`host_transfer`): the sharded fp32
parameters before every all-gather and the sharded gradients after the reduce-scatter.
Not modelled: latency per collective (many small FSDP units cost more than their bytes
say), overlap with compute, and hierarchical (multi-node) algorithms, whose per-rank
byte counts are close to the ring's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.plan.memory import FP32, Variant, Workload, fmt_bytes, fsdp_layout
from disttrain.plan.model_size import ModelSpec


@dataclass
class Comm:
    """Bytes per optimizer step per device, with the collectives that make them up."""

    total: int
    parts: dict[str, int] = field(default_factory=dict)
    host_transfer: int = 0
    """Host<->device copy bytes (CPU offload), not network traffic."""

    def describe(self) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items()) or "none (1 device)"


def ring_factor(world: int) -> float:
    """(N-1)/N: the share of a full tensor each rank sends in all-gather / reduce-scatter."""
    return (world - 1) / world


def communication(spec: ModelSpec, work: Workload, world: int, variant: Variant) -> Comm:
    """Per-device bytes of one optimizer step of `variant` on `world` ranks."""
    f = ring_factor(world)
    if variant.strategy in ("ddp", "zero1"):
        grad_bytes = FP32 * spec.n_params
        parts = {"all-reduce grads": round(2 * f * grad_bytes)}
        if variant.strategy == "zero1":
            parts["all-gather params"] = round(f * FP32 * spec.n_params)
        host = 0
    else:
        padded, _ = fsdp_layout(spec, world)
        full = padded * world  # the unsharded, padded size that each collective covers
        gathers = work.accum_steps * (2 if variant.strategy == "fsdp_full" else 1)
        parts = {
            f"all-gather params x{gathers}": round(gathers * f * work.compute_bytes * full),
            "reduce-scatter grads": round(f * FP32 * full),
        }
        host = (gathers + 1) * FP32 * padded if variant.cpu_offload else 0
    if world == 1:
        parts = {}
    return Comm(total=sum(parts.values()), parts=parts, host_transfer=host)
