"""The end of the one line `disttrain run` prints for an out-of-memory error
(`torch.OutOfMemoryError`, `MemoryError`): the planner's estimate of what the model's
training state takes on each rank under the strategy in use and under FSDP, and the
usual fixes. The failing rank sends the facts (`worker_notes.report_not_retried`'s
`oom`: parameter shapes, strategy, world, optimizer, precision); the arithmetic is
`disttrain.plan.memory`'s, run here in the launching process.
"""

from __future__ import annotations

STATE_OF = {"ddp": "ddp", "zero1": "zero1", "fsdp": "fsdp_full", "fsdp1": "fsdp_full", "fsdp_grad_op": "fsdp_grad_op"}
"""A job's strategy -> the planner's row for it (other strategies: as DDP)."""


def state_bytes(facts: dict, strategy: str) -> int:
    """Weights, gradients and optimizer state per rank (the largest rank) of the model
    in `facts` under the planner's `strategy` row."""
    from disttrain.plan.memory import OPTIMIZERS, PRECISIONS, Variant, Workload, memory
    from disttrain.plan.model_size import ModelSpec

    shapes = [tuple(s) for s in facts.get("shapes") or []] or None
    spec = ModelSpec(
        name="the model",
        n_params=int(facts["params"]),
        n_layer=1,
        hidden=1,
        n_head=1,
        ffn_hidden=1,
        vocab_size=1,
        max_seq=1,
        param_shapes=shapes,
    )
    optimizer = str(facts["optimizer"]) if facts.get("optimizer") in OPTIMIZERS else "adamw"
    precision = str(facts["precision"]) if facts.get("precision") in PRECISIONS else "fp32"
    est = memory(
        spec, Workload(precision=precision, optimizer=optimizer), int(facts.get("world") or 1), Variant(strategy)
    )
    return est.params + est.grads + est.optim


FIXES = (
    "fixes: a smaller batch per rank (raise accum_steps to keep the global batch), activation "
    "checkpointing, or strategy='fsdp' (see `disttrain plan`)"
)


def advice(facts: dict) -> str:
    """'the planner puts ...; fixes: ...' for the line of an out-of-memory error (the
    fixes alone when the model is not known: a plain script's error)."""
    from disttrain.plan.memory import fmt_bytes

    if not facts.get("params"):
        return FIXES
    used = STATE_OF.get(str(facts.get("strategy")), "ddp")
    world = int(facts.get("world") or 1)
    now = state_bytes(facts, used)
    sharded = "" if used.startswith("fsdp") else f" ({fmt_bytes(state_bytes(facts, 'fsdp_full'))} under fsdp)"
    return (
        f"the planner puts the model's weights, gradients and {facts.get('optimizer') or 'optimizer'} "
        f"state at {fmt_bytes(now)} per rank under {facts.get('strategy')} on {world} rank(s)"
        f"{sharded}, before activations; {FIXES}"
    )
