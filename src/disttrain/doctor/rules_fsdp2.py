"""Rules about FSDP2 (`fully_shard`): FSDP1 and DDP habits that do not carry over.

Checked against torch 2.13's source: `FSDPModule` has no `no_sync()` (its
`set_requires_gradient_sync(bool)` is "the equivalence of `no_sync` in FSDP1"), and a
plain `torch.amp.GradScaler` is shard-aware under FSDP2, because the gradients are
DTensors and DTensor's handler for `_amp_foreach_non_finite_check_and_unscale_`
reduces the found-inf flag across the mesh (a MAX over the Shard dimensions), so every
rank skips the same steps without `ShardedGradScaler`. Each check takes `Facts` and
yields `Finding`s; each stays silent unless the source shows the pitfall.
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, kwarg, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, path_witness, rule


def _fsdp2_only(facts: Facts) -> list[str]:
    """Names of the FSDP2 modules when the program is FSDP2 and nothing else (DDP's and
    FSDP1's no_sync is real): `fully_shard(...)` in this file or the others checked with
    it, or an FSDP2 import (`FSDPModule`, `fully_shard`) in a file sharded elsewhere, like
    torchtitan's train step. Empty otherwise."""
    wraps = [w for f in [facts, *facts.others] for w in f.wraps]
    kinds = {w.kind for w in wraps}
    imports = [q.rsplit(".", 1)[-1] for q in facts.aliases.values()]
    if kinds & {"ddp", "fsdp1", "disttrain"}:
        return []
    own = [w.target or w.arg or "model" for w in facts.wraps if w.kind == "fsdp2"]
    if own or "fsdp2" in kinds:
        return own or ["model"]
    if {"fully_shard", "FSDPModule"} & set(imports) and not {
        "DistributedDataParallel",
        "FullyShardedDataParallel",
    } & set(imports):
        return ["model"]  # sharded in another module
    return []


@rule(
    "fsdp2-no-sync",
    ("P-DDP-5", "P-FSDP-9"),
    ERROR,
    "no_sync() or require_backward_grad_sync on an FSDP2 module",
    """`fully_shard` modules (FSDP2) have no `no_sync()` context manager: calling it raises
      AttributeError at the first accumulation micro-step. Setting DDP's
      `require_backward_grad_sync = False` on one is worse: nothing reads it, so gradients
      are still reduce-scattered on every micro-step. FSDP2's switch is
      `model.set_requires_gradient_sync(is_last_microbatch)` (recursing into every
      fully_shard submodule). Accelerate's `accelerator.no_sync(model)` picks the right
      call itself and is not reported.""",
)
def fsdp2_no_sync(facts: Facts):
    targets = _fsdp2_only(facts)
    if not targets:
        return
    name = targets[-1]
    for call in facts.method_calls("no_sync"):
        owner = (ref(call.func.value) or "").split(".")[-1].lower()  # type: ignore[attr-defined]
        if "accelerator" in owner or "fabric" in owner:
            continue  # the library dispatches to FSDP2's setter
        yield finding(
            facts,
            call,
            "fsdp2-no-sync",
            "FSDP2 (fully_shard) modules have no no_sync(): this raises AttributeError "
            "at the first accumulation micro-step.",
            f"call {name}.set_requires_gradient_sync(is_last_microbatch) before each micro-step's backward instead.",
            witness=path_witness(
                facts, [(f"`{name}` is a fully_shard module; no_sync()", call)], "AttributeError on every rank"
            ),
        )
    for n in facts.nodes:
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "require_backward_grad_sync" for t in n.targets
        ):
            yield finding(
                facts,
                n,
                "fsdp2-no-sync",
                "require_backward_grad_sync is DDP's flag; FSDP2 never reads it, so "
                "gradients are still reduce-scattered on every micro-step.",
                f"call {name}.set_requires_gradient_sync(False) on the non-final micro-steps (and True on the last).",
                witness=path_witness(
                    facts,
                    [(f"`{name}` is a fully_shard module; require_backward_grad_sync set", n)],
                    "FSDP2 never reads it: every micro-step still reduce-scatters",
                ),
            )


def _fp16_policy(facts: Facts) -> ast.Call | None:
    """A `MixedPrecisionPolicy(param_dtype=torch.float16)` (FSDP2's precision policy)."""
    for call in facts.calls_to("MixedPrecisionPolicy"):
        dtype = kwarg(call, "param_dtype") or (call.args[0] if call.args else None)
        if dtype is not None and (facts.qualname(dtype) or "").split(".")[-1] in ("float16", "half"):
            return call
    return None


@rule(
    "fsdp2-fp16-without-scaler",
    ("P-DDP-7",),
    WARNING,
    "FSDP2 with fp16 parameters and no GradScaler",
    """With `MixedPrecisionPolicy(param_dtype=torch.float16)` the backward runs in fp16,
      whose 5-bit exponent flushes small gradients to zero before FSDP2 casts them for the
      reduce-scatter: training quietly stalls. Scale the loss with the plain
      `torch.amp.GradScaler("cuda")`: under FSDP2 it is shard-aware (the gradients are
      DTensors and the found-inf check is reduced across the mesh, so all ranks skip the
      same steps), and ShardedGradScaler, FSDP1's, is not needed. bf16 needs no scaler.""",
)
def fsdp2_fp16_without_scaler(facts: Facts):
    if not _fsdp2_only(facts):
        return
    policy = _fp16_policy(facts)
    if policy is None or facts.calls_to("GradScaler", "ShardedGradScaler"):
        return
    yield finding(
        facts,
        policy,
        "fsdp2-fp16-without-scaler",
        "fully_shard computes in fp16 (param_dtype=float16) but no GradScaler scales the "
        "loss: small gradients underflow to zero in the fp16 backward.",
        'scale with torch.amp.GradScaler("cuda") (shard-aware under FSDP2: no '
        "ShardedGradScaler needed), or use param_dtype=torch.bfloat16, which needs none.",
        severity=WARNING,
    )
