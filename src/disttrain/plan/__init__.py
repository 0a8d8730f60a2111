"""`disttrain plan`: memory and communication per strategy, before you launch anything.

For a model (parameter count, disttrain GPT config, or Hugging Face config.json), a
cluster (devices x nodes of some memory) and a workload (precision, optimizer, batch,
sequence length, accumulation), it estimates for DDP, ZeRO-1, FSDP grad_op and FSDP
full - each with and without activation checkpointing, FSDP also with CPU offload -
the per-device memory split into params, grads, optimizer state, activations and
buffers, the bytes each device communicates per step, whether it fits, and recommends
the least-communication strategy that fits with headroom. A second table plans each
tensor-parallel degree with FSDP full over the other ranks (`Plan.tp_rows`) and
recommends the smallest that fits. It also answers P-LOOP-4: effective batch, scaled
learning rate and warmup.

Library use::

    from disttrain.plan import estimate
    plan = estimate("n_layer=4,n_embd=128,n_head=4", devices=2, device_mem="16GiB")
    plan.get("fsdp_full").state_bytes, plan.recommended, plan.reason

What is modelled and what is ignored is written in `disttrain.plan.memory` (memory)
and `disttrain.plan.comm` (communication). In short: persistent state is exact for
native torch (verified against real DDP, ZeroRedundancyOptimizer and `fully_shard`
runs in tests/launch/test_plan.py); activations and transient buffers are formula estimates;
the CUDA context, allocator fragmentation and NCCL buffers are left to the headroom.

Modules: `model_size` (counting), `memory` (bytes per strategy), `comm` (bytes on the
wire), `tp_count` (what a TP plan splits), `tp` (bytes per TP degree), `lr`
(learning-rate rules), `planner` (`estimate`, the recommendations), `report` (table,
JSON, PNG), `cli` (argument parsing).
"""

from __future__ import annotations

from disttrain.plan.lr import LRAdvice, advise, scaled_lr, warmup_steps
from disttrain.plan.model_size import ModelSpec, from_gpt_config, from_hf_config, from_param_count
from disttrain.plan.planner import Plan, StrategyEstimate, estimate, parse_bytes

__all__ = [
    "main",
    "estimate",
    "Plan",
    "StrategyEstimate",
    "ModelSpec",
    "LRAdvice",
    "advise",
    "scaled_lr",
    "warmup_steps",
    "from_gpt_config",
    "from_hf_config",
    "from_param_count",
    "parse_bytes",
]


def main(argv: list[str]) -> int:
    """Entry point of `disttrain plan`; raises `UserError` for bad input (exit 2 in the CLI)."""
    from disttrain.plan.plan_command import run

    return run(list(argv))
