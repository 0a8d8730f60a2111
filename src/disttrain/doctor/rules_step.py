"""Rules about the optimizer step: accumulation, loss scaling, AMP skip, clipping.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, path_witness, rule
from disttrain.doctor.program import off_mode
from disttrain.doctor.rules_loss_division import is_accum_word
from disttrain.doctor.strategy_paths import off_strategy


def _is_optim_word(word: str) -> bool:
    return "optim" in word.lower() or word == "opt"


@rule(
    "accumulation-without-no-sync",
    ("P-DDP-5",),
    WARNING,
    "gradient accumulation without no_sync",
    """DDP all-reduces gradients on every backward. With accumulation, only the last
      micro-step before optimizer.step() needs it: wrap the other micro-steps in
      `with model.no_sync():` to skip (accum_steps - 1) of every accum_steps all-reduces.""",
)
def accumulation_without_no_sync(facts: Facts):
    # the wrap and the loop may sit in different files of one program (main.py wraps,
    # engine.py accumulates)
    if not facts.project.wrap_kinds(facts) & {"ddp", "fsdp1"}:
        return
    if facts.project.no_sync_used(facts):
        return
    for step in facts.method_calls("step"):
        if not mentions(step.func, _is_optim_word):
            continue
        for a in facts.ancestors(step):
            if isinstance(a, ast.If) and (
                mentions(a.test, is_accum_word)
                or any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(a.test))
            ):
                yield finding(
                    facts,
                    step,
                    "accumulation-without-no-sync",
                    "gradients are accumulated over micro-steps, but DDP still all-reduces on every backward.",
                    "run the non-final micro-steps under `with model.no_sync():`.",
                )
                return
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break


_SYNC_WORDS = ("inf", "found", "overflow", "finite", "nan", "skip")


@rule(
    "gradscaler-unsynced",
    ("P-DDP-7",),
    ERROR,
    "fp16 GradScaler in a multi-rank loop without a synced skip",
    """With fp16 GradScaler, every rank must skip the same steps. DDP guarantees it (the
      gradients are all-reduced before unscale, so all ranks see the same inf/nan). With
      FSDP1 (each rank holds a different shard) or a hand-written loop (no DDP), a plain
      GradScaler only sees its own gradients: one rank skips, the others step, and the
      replicas diverge silently. Use ShardedGradScaler for FSDP1, or all-reduce the
      found-inf flag (MAX) before deciding to step. Under FSDP2 (fully_shard) the plain
      torch.amp.GradScaler is right: the gradients are DTensors and the found-inf check
      is reduced across the mesh, so it is not reported there.""",
)
def gradscaler_unsynced(facts: Facts):
    if not facts.distributed and not facts.calls_to("GradScaler"):
        return
    program = facts.project.component(facts)
    if not any(f.distributed for f in program):
        return
    kinds = facts.project.wrap_kinds(facts)  # the wrap may live in the entry script
    if ("ddp" in kinds and "fsdp1" not in kinds) or kinds & {"fsdp2", "disttrain"}:
        return  # DDP syncs gradients before unscale; FSDP2 and disttrain.wrap are not judged
    if any(f.calls_to("ShardedGradScaler") for f in program):
        return
    for f in program:
        for call in f.calls_to("all_reduce", "all_reduce_coalesced"):
            if any(mentions(a, lambda w: any(s in w.lower() for s in _SYNC_WORDS)) for a in call.args):
                return  # the found-inf flag is already agreed across ranks
    modes = facts.project.fsdp_mode_flags(facts)
    for call in facts.calls_to("GradScaler"):
        if is_const(kwarg(call, "enabled"), False):
            continue
        sharded = [(f, w) for f in program for w in f.wraps if w.kind == "fsdp1"]
        if "fsdp1" in kinds and (off_mode(facts, call, modes) or off_strategy(facts, call, sharded)):
            continue  # `assert not args.fsdp` before it: the DDP path, where the plain scaler is right
        if "fsdp1" in kinds:
            yield finding(
                facts,
                call,
                "gradscaler-unsynced",
                "GradScaler with FSDP shards: each rank checks only its own gradients for "
                "inf/nan, so ranks can disagree on skipping a step and diverge silently.",
                "use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (FSDP), or "
                "all_reduce the found-inf flag with ReduceOp.MAX before scaler.step(); or use "
                "bf16 autocast, which needs no scaler.",
                witness=path_witness(
                    facts,
                    [("a plain GradScaler over FSDP1-sharded gradients", call)],
                    "an inf in one rank's shard skips the step there only: the ranks' weights part",
                ),
            )
            continue
        # No wrap in the files checked: the model is usually wrapped out of view (then the
        # plain scaler is right). Only a hand-written gradient all-reduce shows there is no
        # DDP; then it is a warning that says what it could not see.
        if not _manual_grad_reduce(program) or _reduced_before_scaler_step(program):
            continue
        yield finding(
            facts,
            call,
            "gradscaler-unsynced",
            "GradScaler in a multi-rank program that all-reduces gradients by hand (no "
            "DDP/FSDP wrap in the files checked): unscale_ runs on each rank's own view, so "
            "unless the gradients are reduced before it, ranks can disagree on skipping a "
            "step. Under DDP (wrapped in a file not checked) it is right.",
            "check the file that wraps the model in the same run; without DDP, all_reduce the "
            "found-inf flag with ReduceOp.MAX before scaler.step().",
            severity=WARNING,
        )


def _grad_reduces(call: ast.Call) -> bool:
    return bool(call.args) and mentions(call.args[0], lambda w: "grad" in w.lower())


def _reduced_before_scaler_step(program) -> bool:
    """Every `scaler.step()` comes after a gradient all-reduce in its function (directly, or
    through a project function that does one: LSGM's `average_gradients`) and no
    `unscale_` comes before that reduce: the ranks unscale the same, reduced gradients."""
    reducers = {
        n.name
        for f in program
        for n in f.nodes
        if isinstance(n, ast.FunctionDef)
        and any(
            isinstance(c, ast.Call) and (ref(c.func) or "").rsplit(".", 1)[-1] in _REDUCES and _grad_reduces(c)
            for c in ast.walk(n)
        )
    }
    steps = [(f, c) for f in program for c in f.method_calls("step") if "scal" in (ref(c.func.value) or "").lower()]  # type: ignore[attr-defined]
    if not steps:
        return False
    for f, step in steps:
        fn = f.scope_of(step)
        calls = [c for c, _ in f.calls if f.scope_of(c) is fn and c.lineno < step.lineno]
        reduce_at = [
            c.lineno
            for c in calls
            if (name := (ref(c.func) or "").rsplit(".", 1)[-1]) in reducers or (name in _REDUCES and _grad_reduces(c))
        ]
        unscale_at = [c.lineno for c in calls if (ref(c.func) or "").endswith("unscale_")]
        if not reduce_at or any(u < min(reduce_at) for u in unscale_at):
            return False
    return True


_REDUCES = ("all_reduce", "all_reduce_coalesced", "reduce_scatter")


def _manual_grad_reduce(program) -> bool:
    """A hand-written gradient all-reduce (`dist.all_reduce(p.grad)`): no DDP."""
    for f in program:
        for call in f.calls_to("all_reduce", "all_reduce_coalesced", "reduce_scatter"):
            if call.args and mentions(call.args[0], lambda w: "grad" in w.lower()):
                return True
    return False


@rule(
    "fsdp1-clip-grad",
    ("P-LOOP-5",),
    ERROR,
    "torch.nn.utils.clip_grad_norm_ on an FSDP1 module",
    """Under FullyShardedDataParallel (FSDP1) each rank holds a shard of every gradient,
      so torch.nn.utils.clip_grad_norm_ computes a different, local norm on each rank
      and clips each shard by a different factor. Call the wrapped module's own
      `model.clip_grad_norm_(max_norm)`, which all-reduces the total norm.""",
)
def fsdp1_clip_grad(facts: Facts):
    fsdp = [w for w in facts.wraps if w.kind == "fsdp1"]
    if not fsdp:
        return
    name = fsdp[0].target or "model"
    for call in facts.calls_to("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_"):
        if off_strategy(facts, call, [(facts, w) for w in fsdp]):
            continue  # the DDP branch of `if engine == "fsdp": ... else: ...`
        yield finding(
            facts,
            call,
            "fsdp1-clip-grad",
            "torch.nn.utils.clip_grad_norm_ on FSDP-sharded gradients clips each rank's "
            "shard by its own local norm, not the global one.",
            f"call {name}.clip_grad_norm_(max_norm) on the FSDP module instead.",
            witness=path_witness(
                facts,
                [("FSDP wrap", fsdp[0].call), ("torch.nn.utils.clip_grad_norm_", call)],
                "each rank clips its shard by its own norm: the ranks' updates differ",
            ),
        )


def _is_optimizer_step(call: ast.Call) -> bool:
    """`optimizer.step()`, `self.opt.step()`, `scaler.step(optimizer)`; not a scheduler's."""
    return mentions(call.func, _is_optim_word) or any(mentions(a, _is_optim_word) for a in call.args)


def _mod_zero(test: ast.AST | None, branch: str) -> ast.BinOp | None:
    """The `i % n` whose being 0 sends control into `branch` ("body" or "orelse") of an
    `if` with this test: `i % n == 0` or `not i % n` (a part of an `or` included) for
    the body, `i % n != 0` or a bare `i % n` for the else branch. None otherwise."""
    if branch == "body" and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return next((m for v in test.values if (m := _mod_zero(v, "body"))), None)
    if branch == "body" and isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, branch = test.operand, "orelse"  # `not i % n` is true when `i % n` is falsy
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and _is_zero(test.comparators[0]):
        wanted = ast.Eq if branch == "body" else ast.NotEq
        test = test.left if isinstance(test.ops[0], wanted) else None
    elif branch == "body":
        return None
    if (
        isinstance(test, ast.BinOp)
        and isinstance(test.op, ast.Mod)
        and isinstance(test.left, ast.Name)
        and not (isinstance(test.right, ast.Constant) and test.right.value in (0, 1))
    ):
        return test
    return None


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _zero_based_index_loop(facts: Facts, start: ast.AST, name: str) -> ast.For | None:
    """The loop around `start` that binds `name` as enumerate()'s index counting from 0
    (`for name, batch in enumerate(loader)`), runs a backward() and never reassigns
    `name` in its body; None when there is none (or the index starts at 1)."""
    for a in facts.ancestors(start):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return None
        if not isinstance(a, ast.For):
            continue
        target, it = a.target, a.iter
        if not (
            isinstance(target, ast.Tuple)
            and target.elts
            and isinstance(target.elts[0], ast.Name)
            and target.elts[0].id == name
        ):
            continue
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate"):
            return None
        first = kwarg(it, "start") or (it.args[1] if len(it.args) > 1 else None)
        if first is not None and not _is_zero(first):
            return None
        body = [n for s in a.body for n in ast.walk(s)]
        rebinds = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in body)
        backward = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward" for n in body
        )
        return a if backward and not rebinds else None
    return None


@rule(
    "accumulation-off-by-one",
    ("P-DDP-5",),
    WARNING,
    "optimizer step when a 0-based enumerate index % N == 0",
    """With gradient accumulation over N micro-batches, `for step, batch in
      enumerate(loader): ... if step % N == 0: optimizer.step()` steps at step 0, after
      the first micro-batch alone, and only then every N: each epoch starts with a
      one-micro-batch update and every later window is shifted by one. The else branch
      of `if step % N != 0` is the same test. enumerate() counts from 0: test `(step + 1) % N == 0`, or count
      from 1 with `enumerate(loader, start=1)`. (transformers' `*_no_trainer.py`
      examples and Accelerate's nlp_example.py carried this test; huggingface/transformers#15801.)""",
)
def accumulation_off_by_one(facts: Facts):
    for call in facts.method_calls("step"):
        if not _is_optimizer_step(call):
            continue
        child: ast.AST = call
        for a in facts.ancestors(call):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.For, ast.While)):
                break  # the test must guard the step within one iteration of the loop
            if isinstance(a, ast.If) and child is not a.test:
                mod = _mod_zero(a.test, "body" if child in a.body else "orelse")
                if (
                    mod is not None and isinstance(mod.left, ast.Name) and _zero_based_index_loop(facts, a, mod.left.id)
                ):  # (_mod_zero checked the Name)
                    i, n = mod.left.id, ast.unparse(mod.right)
                    yield finding(
                        facts,
                        call,
                        "accumulation-off-by-one",
                        f"the optimizer steps when `{i} % {n}` is 0, and `{i}` comes from "
                        f"enumerate(), which counts from 0: the first step comes after one "
                        f"micro-batch, then every {n}, so each epoch's first update "
                        "accumulates a single micro-batch.",
                        f"test `({i} + 1) % {n} == 0`, or count from 1 with `enumerate(..., start=1)`.",
                    )
                    break
            child = a
