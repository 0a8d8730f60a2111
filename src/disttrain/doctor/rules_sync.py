"""Rules about collectives: one under a rank guard (a hang), padded evaluation shards.

A collective (`dist.barrier`, `all_reduce`, `accelerator.wait_for_everyone`, a DCP
save ...) completes only when every rank of the group calls it. Each check takes
`Facts` and yields `Finding`s; each stays silent unless the source shows the pitfall
(a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor import constants, control_flow, dataflow, guard_names, rank_runs
from disttrain.doctor.facts import Facts, arg, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, rule
from disttrain.doctor.names import FUNCTION_NODES
from disttrain.doctor.program import off_mode
from disttrain.doctor.rules_launch import is_eval_name, sampler_names

# Which calls are collectives: names.collective_name (torch.distributed's, Accelerate's,
# Fabric's, Lightning 2.1's Trainer.save_checkpoint, MPI-style communicators', DCP's).

# Results of these are gathered or summed across ranks: padded duplicates get counted.
_GATHERS = {
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "gather",
    "gather_object",
    "all_reduce",
    "reduce",
}


def collectives(facts: Facts) -> list[tuple[ast.Call, str]]:
    """Every collective call with its short name (`barrier`, `wait_for_everyone`, ...):
    torch.distributed's, Accelerate's, Fabric's, MPI-style communicators', DCP's state-dict
    helpers and an FSDP1 module's `state_dict()` (dataflow.collective_name)."""
    targets = facts.project.fsdp1_targets(facts)
    modes = facts.project.fsdp_mode_flags(facts)
    out = []
    for call, _ in facts.calls:
        name = dataflow.collective_name(facts, call, targets)
        if name == "FSDP state_dict" and off_mode(facts, call, modes):
            continue  # `cpu_state if args.fsdp else model.state_dict()`: the DDP path
        if name:
            out.append((call, name))
    return out


def _has_partner(facts: Facts, call: ast.Call, name: str, ifs, all_calls) -> bool:
    """True when the ranks the guard leaves out call the same collective elsewhere in the
    function: the other branch of the same `if`, or another rank-guarded `if` with a
    different test (HF's `if local_rank not in [-1, 0]: barrier()` ... `if local_rank ==
    0: barrier()`, main process first)."""
    guard, in_body = ifs[0]
    scope = facts.scope_of(call)
    test = ast.unparse(guard.test)
    for other, other_name in all_calls:
        if other is call or other_name != name or facts.scope_of(other) is not scope:
            continue
        other_ifs = guard_names.guarding_ifs(facts, other)
        if not other_ifs:
            continue
        o_guard, o_body = other_ifs[0]
        if o_guard is guard and o_body != in_body:
            return True
        if o_guard is not guard and ast.unparse(o_guard.test) != test:
            return True
    return False


@rule(
    "collective-under-rank-guard",
    ("P-LOOP-1", "P-DEBUG-1"),
    ERROR,
    "a collective that only some ranks reach",
    """A collective (dist.barrier, all_reduce, all_gather, broadcast, a DCP save or load,
      accelerator.wait_for_everyone/gather, fabric.barrier, Lightning's
      trainer.save_checkpoint from 2.1, which ends in a barrier ...) returns only when
      every rank of the group has called it. Under `if rank == 0:` (or its else branch, after an early
      `if rank != 0: return`, or in a function called only under such a guard, like
      `@rank_zero_only`) the other ranks never arrive and the job hangs until the collective
      timeout. Run the collective on every rank and guard only the file or log write. The
      main-process-first pattern, the same collective under complementary guards (`if
      rank != 0: barrier()` ... `if rank == 0: barrier()`), is balanced and not reported.""",
)
def collective_under_rank_guard(facts: Facts):
    found = collectives(facts)
    for call, name in found:
        kind = facts.rank_guard(call, subset=True)
        if kind in (None, control_flow.SOLO):
            continue
        ifs = guard_names.guarding_ifs(facts, call)
        if not ifs and _only_distributed_checks(facts, call):
            continue
        verdict = rank_runs.witness_for(facts, call)
        if verdict == rank_runs.PAIRED or (
            isinstance(verdict, rank_runs.Unseen) and ifs and _has_partner(facts, call, name, ifs, found)
        ):
            continue  # every rank class issues the same collectives: the pattern pairs up
        if facts.rank_guard(call) is None:  # reached only past an exit on rank 0
            unseen = guard_names.named_exit(facts, call)
            yield _witnessed(
                facts,
                call,
                verdict,
                f"{name}() is a collective, but an earlier `return`/exit on the guarded rank "
                "(rank 0) leaves only the other ranks to reach it: they wait for rank 0 "
                "until the collective timeout." + guard_names.unseen_note(unseen),
                "let every rank reach the collective (move the early exit after it, or exit on every rank).",
                unseen,
            )
            continue
        via = ""
        if facts.rank_guard(call, subset=True, local=True) is None:
            fn = facts.scope_of(call)
            sites = facts.project.call_sites.get(fn, [])
            if sites and not any(constants.call_reaches(facts.project, facts, c2, fn, call) for _, c2 in sites):
                continue  # every call passes constants that turn this collective off
            if sites and isinstance(fn, FUNCTION_NODES):  # (a function is what has call sites)
                f2, c2 = sites[0]
                via = f" (`{fn.name}()` is called only under one, e.g. {f2.path}:{c2.lineno})"
        unseen = guard_names.named_guard(facts, call)
        yield _witnessed(
            facts,
            call,
            verdict,
            f"{name}() is a collective but runs under a rank guard{via}: the ranks the guard "
            "leaves out never call it, and the job hangs until the collective timeout."
            + guard_names.unseen_note(unseen),
            "call it on every rank (outside the `if`), and guard only the work that must "
            "happen once (the write, the log).",
            unseen,
        )
    yield from _guarded_calls_into_collectives(facts, found)
    yield from _guarded_accelerate_states(facts)


def _witnessed(facts: Facts, node: ast.AST, verdict, message: str, fix: str, unseen, error: bool = True):
    """The finding with its witness: an error only when the doctor shows the failing run
    (and the guard is proven); a warning that says what it could not see otherwise."""
    if isinstance(verdict, rank_runs.Witness):
        return finding(
            facts,
            node,
            "collective-under-rank-guard",
            message,
            fix,
            severity=ERROR if error and not unseen else WARNING,
            witness=verdict.text,
        )
    reason = verdict.reason if isinstance(verdict, rank_runs.Unseen) else "no failing run was found"
    return finding(
        facts,
        node,
        "collective-under-rank-guard",
        f"{message} The doctor shows no failing run: {reason}.",
        fix,
        severity=WARNING,
    )


def _guarded_accelerate_states(facts: Facts):
    """`accelerator.save_state()` / `load_state()` under a rank guard: under DeepSpeed
    (its save_checkpoint) or FSDP (the sharded state dict) a collective, which the launch
    config (out of view) selects; under DDP not one. A warning that says so. A guard that
    lets the DeepSpeed path in (`is_main_process or distributed_type == DEEPSPEED`) is
    balanced. A program that names neither DeepSpeed nor FSDP anywhere in view is taken to
    run under DDP (its recipes launch plain multi-GPU Accelerate)."""
    if not any(
        w in f.source.lower() for f in facts.project.component(facts) for w in ("deepspeed", "fsdp", "fully_sharded")
    ):
        return
    for call in (*facts.method_calls("save_state"), *facts.method_calls("load_state")):
        owner = (ref(call.func.value) or "").lower()  # type: ignore[attr-defined]
        if "accel" not in owner:
            continue  # a HF Trainer's save_state writes trainer_state.json: no collective
        kind = facts.rank_guard(call, subset=True)
        if kind in (None, control_flow.SOLO):
            continue
        if any(
            "deepspeed" in ast.unparse(i.test).lower() or "distributed_type" in ast.unparse(i.test)
            for i, _ in guard_names.guarding_ifs(facts, call)
        ):
            continue
        yield finding(
            facts,
            call,
            "collective-under-rank-guard",
            f"{ast.unparse(call.func)}() runs under a rank guard. Under DeepSpeed or FSDP (chosen "
            "by the launch config, which the doctor does not see) it is a collective (DeepSpeed's "
            "save_checkpoint, FSDP's sharded state dict): the ranks the guard leaves out never "
            "join it and the job hangs. Under DDP it only saves on this rank.",
            "call it on every rank (Accelerate writes once where it must), or let the DeepSpeed "
            "path in: `if accelerator.is_main_process or accelerator.distributed_type == "
            "DistributedType.DEEPSPEED:`.",
            severity=WARNING,
        )


def _guarded_calls_into_collectives(facts: Facts, direct: list):
    """A call under a rank guard into a project function that reaches a collective
    (`if rank == 0: evaluate(model)` where evaluate all-reduces or runs the DDP model;
    a broadcast-based loader called on rank 0 only), and the DDP-wrapped model's own
    forward under a guard (DDP broadcasts buffers at every forward)."""
    project = facts.project
    direct_calls = {id(c) for c, _ in direct}
    ddp = project.ddp_targets
    for call, _q in facts.calls:
        if id(call) in direct_calls:
            continue
        # cheap first: only a call that reaches a collective or touches the DDP model counts
        if not (
            project.reached_collective(facts, call) or ref(call.func) in ddp or any(ref(a) in ddp for a in call.args)
        ):
            continue
        kind = facts.rank_guard(call, subset=True)
        if kind in (None, control_flow.SOLO):
            continue
        hit = project.reached_collective(facts, call)
        callees = [d for _, d in project.resolve(facts, call)]
        if hit is not None and any(d in facts.guarded_functions for d in callees):
            continue  # the callee runs under the guard on every call: its collective is reported there
        if hit is not None and any(dataflow.complementary_sites(project.call_sites.get(d, [])) for d in callees):
            continue  # called from both branches of one rank test: every rank reaches it
        if hit is not None:
            # `build_loader(..., rank=-1)`: the constants it passes may turn the collective off
            hit = constants.reached_collective(project, facts, call)
            if hit is None:
                continue
        target = ref(call.func)
        if (
            hit is None
            and target in ddp
            and _same_program(facts, ddp[target])
            and not _before_wrap(facts, call, ddp[target])
        ):
            yield finding(
                facts,
                call,
                "collective-under-rank-guard",
                f"`{target}` is the DDP-wrapped model (line {ddp[target].call.lineno}): its "
                "forward broadcasts the module's buffers from rank 0 (broadcast_buffers=True, "
                "the default), a collective; under this rank guard the other ranks never "
                "join it. The doctor cannot see whether the module has buffers (BatchNorm, "
                "running stats); if it has, this hangs.",
                f"run {target}.module(...) on the guarded rank, or evaluate on every rank.",
                severity=WARNING,
            )
            continue
        if hit is None:
            called_at = _ddp_model_passed(facts, call, ddp)
            if called_at is None:
                continue
            yield finding(
                facts,
                call,
                "collective-under-rank-guard",
                f"{ast.unparse(call.func)}() is given the DDP-wrapped model and calls it "
                f"({called_at}); DDP's forward broadcasts buffers from rank 0, a collective that "
                "the ranks this guard leaves out never join. The doctor cannot see whether "
                "the module has buffers (BatchNorm); if it has, this hangs.",
                "pass model.module to code that runs on one rank only, or run it on every rank.",
                severity=WARNING,
            )
            continue
        f2, c2, name, unconditional = hit
        where = f"{f2.path}:{c2.lineno}"
        unseen = guard_names.named_guard(facts, call)
        verdict = rank_runs.witness_for(facts, call)
        if verdict == rank_runs.PAIRED:
            continue
        yield _witnessed(
            facts,
            call,
            verdict,
            f"{ast.unparse(call.func)}() reaches the collective {name} ({where}) but is "
            "called under a rank guard: the other ranks never join it"
            + (
                ", and the job hangs until the collective timeout."
                if unconditional
                else " on the paths where it runs (it sits under a condition there)."
            )
            + (
                f" The doctor takes `{unseen}` for a rank from its name alone: it cannot see where its value is set."
                if unseen
                else ""
            ),
            "call it on every rank, or make the callee skip its collective on one-rank calls.",
            unseen,
            error=unconditional,
        )


def _before_wrap(facts: Facts, call: ast.Call, wrap) -> bool:
    """The call runs before the wrap in the same function: the name is still the bare module."""
    return facts.scope_of(call) is wrap.scope and call.lineno < wrap.call.lineno and any(w is wrap for w in facts.wraps)


def _same_program(facts: Facts, wrap) -> bool:
    comp = {id(f) for f in facts.project.component(facts)}
    return any(w is wrap and id(f) in comp for f, w in facts.project.wraps)


def _ddp_model_passed(facts: Facts, call: ast.Call, ddp: dict) -> str | None:
    """`evaluate(model, loader)` with `model` the DDP wrapper, into a project function that
    calls that parameter: where it calls it."""
    for i, a in enumerate(call.args):
        r = ref(a)
        if r not in ddp or not _same_program(facts, ddp[r]):
            continue
        for f2, d in facts.project.resolve(facts, call):
            params = [p.arg for p in d.args.args]
            if params and params[0] in ("self", "cls"):
                params = params[1:]
            if i >= len(params):
                continue
            p = params[i]
            for n in ast.walk(d):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == p:
                    return f"{f2.path}:{n.lineno}"
    return None


def _only_distributed_checks(facts: Facts, call: ast.Call) -> bool:
    """The guard rank_guard saw is an `if local_rank != -1` test (no real guard)."""
    child = call
    for a in facts.ancestors(call):
        if isinstance(a, ast.If) and child is not a.test and control_flow.is_rank_test(facts, a.test):
            return guard_names.is_distributed_check(a.test)
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        child = a
    return False


@rule(
    "eval-gather-padded",
    ("P-DATA-1", "P-LOOP-2"),
    WARNING,
    "evaluation shards padded with duplicates, then gathered or summed",
    """DistributedSampler (drop_last=False, the default) and Accelerate's prepared
      loaders pad the last shard by repeating samples so every rank gets as many. Training
      does not mind; evaluation does: results gathered (all_gather, accelerator.gather) or
      summed (all_reduce) across ranks count up to world_size - 1 samples twice, and the
      metric changes with the number of GPUs. Truncate the gathered results to
      len(dataset), count only real samples, or use accelerator.gather_for_metrics, which
      drops the padding. drop_last=True is no fix: it drops samples instead.""",
)
def eval_gather_padded(facts: Facts):
    yield from _padded_samplers(facts)
    yield from _accelerate_gathers(facts)
    yield from _fabric_reductions(facts)


def _padded_samplers(facts: Facts):
    """Evaluation DistributedSamplers whose loader is looped over in a function that
    gathers or sums across ranks."""
    gathers = [c for c, name in collectives(facts) if name in _GATHERS and not _truncates(facts.scope_of(c))]
    if not gathers:
        return
    for call in facts.calls_to("DistributedSampler"):
        if is_const(arg(call, 5, "drop_last"), True):
            continue
        names = sampler_names(facts, call)
        dataset = ref(arg(call, 0, "dataset") or call) or ""
        if not any(is_eval_name(n) for n in names | {dataset}):
            continue
        loops = {
            facts.scope_of(n)
            for n in facts.nodes
            if isinstance(n, (ast.For, ast.AsyncFor))
            and mentions(n.iter, lambda w, names=names: is_eval_name(w) or w in names)
        }
        if any(facts.scope_of(c) in loops for c in gathers):
            yield finding(
                facts,
                call,
                "eval-gather-padded",
                "this evaluation sampler pads the last shard with repeated samples "
                "(drop_last=False), and the evaluation loop gathers or sums results across "
                "ranks: the metric counts up to world_size - 1 samples twice.",
                "truncate the gathered predictions to len(dataset) (or count only real "
                "samples); drop_last=True would drop samples instead.",
            )


def _accelerate_gathers(facts: Facts):
    """accelerator.gather (not gather_for_metrics) inside a loop over an evaluation loader."""
    loops = set()  # one finding per evaluation loop
    for call, name in collectives(facts):
        if name != "gather" or not isinstance(call.func, ast.Attribute):
            continue
        loop = facts.enclosing_loop(call)
        if (
            loop is not None
            and loop not in loops
            and isinstance(loop, (ast.For, ast.AsyncFor))
            and mentions(loop.iter, is_eval_name)
            and not _truncates_after(facts, loop)
        ):
            loops.add(loop)
            yield finding(
                facts,
                call,
                "eval-gather-padded",
                "accelerator.gather() over an evaluation loader keeps the samples "
                "Accelerate repeated to fill the last batch: the metric counts them twice.",
                "use accelerator.gather_for_metrics(...), which drops the padding.",
            )


def _fabric_reductions(facts: Facts):
    """fabric.all_gather/all_reduce in an evaluation function of a script whose loaders go
    through `fabric.setup_dataloaders` (a padding DistributedSampler by default)."""
    if not facts.method_calls("setup_dataloaders") or any(
        is_const(kwarg(c, "use_distributed_sampler"), False) for c in facts.calls_to("Fabric")
    ):
        return
    for call, name in collectives(facts):
        owner = (ref(call.func.value) or "").lower() if isinstance(call.func, ast.Attribute) else ""
        if "fabric" not in owner or name not in ("all_gather", "all_reduce"):
            continue
        scope = facts.scope_of(call)
        if _truncates(scope):
            continue
        named = isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_eval_function(scope.name)
        looped = any(
            isinstance(n, (ast.For, ast.AsyncFor))
            and facts.scope_of(n) is scope
            and mentions(n.iter, lambda w: "loader" in w.lower())
            for n in facts.nodes
        )
        if looped and (
            named
            or any(
                isinstance(n, (ast.For, ast.AsyncFor)) and facts.scope_of(n) is scope and mentions(n.iter, is_eval_name)
                for n in facts.nodes
            )
        ):
            yield finding(
                facts,
                call,
                "eval-gather-padded",
                f"fabric.{name}() over an evaluation loader that setup_dataloaders gave a "
                "DistributedSampler: the padded repeats of the last shard are counted.",
                "count only real samples (sum a per-sample mask with the values), or "
                "evaluate with Fabric(use_distributed_sampler=False) on one rank.",
            )


def _is_eval_function(name: str) -> bool:
    return is_eval_name(name) or name.lower().startswith(("validate", "evaluate"))


def _truncates_after(facts: Facts, loop: ast.AST) -> bool:
    """The loop, or a statement after it in the same block, cuts the gathered results
    (run_clm_no_trainer: `losses = losses[: len(eval_dataset)]` after the eval loop)."""
    parent = facts.parents.get(loop)
    for field in ("body", "orelse", "finalbody"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and loop in block:
            return any(_truncates(stmt) for stmt in block[block.index(loop) :])
    return _truncates(loop)


def _truncates(node: ast.AST) -> bool:
    """The code cuts gathered results back to the dataset's length: `x[: len(ds)]`
    (HF's no_trainer scripts: `predictions[: len(eval_dataloader.dataset) - samples_seen]`)."""
    for n in ast.walk(node):
        if (
            isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Slice)
            and n.slice.upper is not None
            and any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "len"
                for c in ast.walk(n.slice.upper)
            )
        ):
            return True
    return False
