"""Rules for scripts built on `dt.Job` (disttrain.train.job.Job), the loop the README
recommends: the job owns the backward, the optimizer and scheduler steps and the wrap,
so doing them again by hand is a wrong result (or the job's own UserError at start).

A Job is recognised by its constructor (`dt.Job(...)`, `disttrain.Job(...)`,
`from disttrain import Job`) bound by `with ... as job` or `job = ...`; its loop is
`for batch in job.steps(...)`. Each check takes `Facts` and yields `Finding`s.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TypeGuard

from disttrain.doctor.facts import Facts, kwarg, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, path_witness, rule
from disttrain.doctor.rules_ddp import is_optimizer, param_refs

_JOB = ("disttrain.Job", "disttrain.train.Job", "disttrain.train.job.Job")


def _jobs(facts: Facts) -> set[str]:
    """Names bound to a dt.Job."""
    out = set()
    for call in facts.calls_to(*_JOB):
        parent = facts.parents.get(call)
        if isinstance(parent, ast.withitem) and parent.optional_vars is not None:
            out.add(ref(parent.optional_vars))
        elif isinstance(parent, ast.Assign):
            out |= {ref(t) for t in parent.targets}
    return {n for n in out if n}


def job_windows(facts: Facts) -> dict[str, ast.expr]:
    """Names bound to a dt.Job that accumulates, with its `accum_steps` argument: every Job
    built with one that is not the constant 1 (the default). Its `job.backward(loss)`
    divides the loss by accum_steps itself."""
    out = {}
    for call in facts.calls_to(*_JOB):
        steps = kwarg(call, "accum_steps")
        if steps is None or (isinstance(steps, ast.Constant) and steps.value == 1):
            continue
        parent = facts.parents.get(call)
        targets = (
            [parent.optional_vars]
            if isinstance(parent, ast.withitem) and parent.optional_vars
            else parent.targets
            if isinstance(parent, ast.Assign)
            else []
        )
        out.update({r: steps for t in targets if (r := ref(t))})
    return out


def _job_call(node: ast.AST, jobs: set[str], method: str) -> TypeGuard[ast.Call]:
    """`node` is `<job>.method(...)` for one of the `jobs` names."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and ref(node.func.value) in jobs
    )


def _step_loops(facts: Facts, jobs: set[str]) -> list[ast.For | ast.AsyncFor]:
    return [n for n in facts.nodes if isinstance(n, (ast.For, ast.AsyncFor)) and _job_call(n.iter, jobs, "steps")]


def _in_body(loop: ast.For | ast.AsyncFor) -> Iterator[ast.AST]:
    for stmt in loop.body:
        yield from ast.walk(stmt)


def _resume_kwarg(facts: Facts, jobs: set[str], name: str) -> set[str]:
    out = set()
    for n in facts.nodes:
        if _job_call(n, jobs, "resume"):
            v = kwarg(n, name)
            r = ref(v) if v is not None else None
            if r:
                out.add(r)
    return out


@rule(
    "job-scheduler-stepped-twice",
    ("P-LOOP-3",),
    ERROR,
    "a scheduler given to job.resume() and stepped again in job.steps()",
    """`job.resume(..., scheduler=sched)` hands the scheduler to the job, which steps it
      on every optimizer step (at the accumulation boundary) and checkpoints it. A
      `sched.step()` inside `for batch in job.steps(...)` steps it again, on every
      micro-batch: the learning-rate schedule runs (accum_steps + 1) times too fast. Remove
      the manual step. A scheduler the job was not given is stepped per micro-batch and is
      not checkpointed: pass it to job.resume().""",
)
def job_scheduler_stepped_twice(facts: Facts):
    jobs = _jobs(facts)
    if not jobs:
        return
    given = _resume_kwarg(facts, jobs, "scheduler")
    for loop in _step_loops(facts, jobs):
        for n in _in_body(loop):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"):
                continue
            owner = ref(n.func.value) or ""
            if owner in given:
                yield finding(
                    facts,
                    n,
                    "job-scheduler-stepped-twice",
                    f"`{owner}` was given to job.resume(scheduler=...), so the job already "
                    "steps it at every optimizer step; this second step() inside job.steps() "
                    "runs the schedule too fast.",
                    f"remove {owner}.step(); the job steps it.",
                    witness=path_witness(
                        facts,
                        [("job.steps()", loop), (f"{owner}.step()", n)],
                        "the job steps it too: the schedule runs ahead",
                    ),
                )
            elif "sched" in owner.lower() or owner.lower().endswith("lr"):
                yield finding(
                    facts,
                    n,
                    "job-scheduler-stepped-twice",
                    f"`{owner}.step()` inside job.steps() runs on every micro-batch, and the job "
                    "does not checkpoint this scheduler: the schedule depends on accum_steps "
                    "and restarts on resume.",
                    f"pass it to job.resume(scheduler={owner}) and remove the manual step().",
                    severity=WARNING,
                )


@rule(
    "job-optimizer-before-wrap",
    ("P-DDP-3", "P-FSDP-7"),
    ERROR,
    "an optimizer built before job.wrap()",
    """`job.wrap(model)` returns the wrapped model (DDP, or FSDP whose sharding replaces
      the parameters). An optimizer built from the bare model's parameters before the
      wrap updates tensors the wrapped model may no longer use; dt.Job refuses it at
      job.resume() with a UserError. Build the optimizer from the module job.wrap()
      returned.""",
)
def job_optimizer_before_wrap(facts: Facts):
    jobs = _jobs(facts)
    if not jobs:
        return
    wraps = [n for n in facts.nodes if _job_call(n, jobs, "wrap") and n.args]
    opts = [(c, param_refs(c)) for c, q in facts.calls if is_optimizer(q)]
    for w in wraps:
        arg = ref(w.args[0])
        parent = facts.parents.get(w)
        target = ref(parent.targets[0]) if isinstance(parent, ast.Assign) and len(parent.targets) == 1 else None
        if not arg:
            continue
        for call, refs in opts:
            if arg not in refs or call.lineno >= w.lineno or facts.scope_of(call) is not facts.scope_of(w):
                continue
            rebuilt = any(c.lineno > w.lineno and (target in rs or arg in rs) for c, rs in opts)
            if rebuilt:
                continue
            yield finding(
                facts,
                call,
                "job-optimizer-before-wrap",
                f"the optimizer takes `{arg}`'s parameters before job.wrap() (line {w.lineno}): "
                "it must hold the wrapped model's parameters (dt.Job raises a UserError at "
                "resume; under FSDP they are other tensors).",
                f"build the optimizer after `{target or arg} = job.wrap(...)`, from its parameters().",
                witness=path_witness(
                    facts,
                    [(f"the optimizer takes `{arg}`'s parameters", call), ("job.wrap()", w)],
                    "job.resume() raises a UserError",
                ),
            )


@rule(
    "job-manual-step",
    ("P-DDP-5", "P-LOOP-3"),
    ERROR,
    "loss.backward() or optimizer.step() by hand inside job.steps()",
    """Inside `for batch in job.steps(...)` the job does the backward (`job.backward(loss)`:
      divided by the accumulation window, no_sync on the micro-steps) and steps the
      optimizer at the boundary. A leftover `loss.backward()` adds a second, unscaled
      gradient (or, without job.backward, the job stops with a UserError), and a leftover
      `optimizer.step()` / `zero_grad()` steps or clears on every micro-batch. Keep only
      job.backward(loss).""",
)
def job_manual_step(facts: Facts):
    jobs = _jobs(facts)
    if not jobs:
        return
    for loop in _step_loops(facts, jobs):
        for n in _in_body(loop):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            owner = ref(n.func.value) or ast.unparse(n.func.value)
            if owner in jobs:
                continue
            attr = n.func.attr
            if attr == "backward" and not n.args:
                yield finding(
                    facts,
                    n,
                    "job-manual-step",
                    f"`{ast.unparse(n.func)}()` inside job.steps(): the job does the backward "
                    "(job.backward(loss), scaled for accumulation, with no_sync); this one adds "
                    "an unscaled second gradient, or without job.backward the job stops.",
                    "replace it with job.backward(loss).",
                    witness=path_witness(
                        facts, [("job.steps()", loop), (f"{ast.unparse(n.func)}()", n)], "an unscaled second gradient"
                    ),
                )
            elif attr == "step" and ("optim" in owner.lower() or owner.lower() in ("opt", "scaler")):
                yield finding(
                    facts,
                    n,
                    "job-manual-step",
                    f"`{ast.unparse(n.func)}()` inside job.steps(): the job steps the optimizer "
                    "at the accumulation boundary; this steps it again on every micro-batch.",
                    "remove it; the job steps the optimizer.",
                    witness=path_witness(
                        facts,
                        [("job.steps()", loop), (f"{ast.unparse(n.func)}()", n)],
                        "an optimizer step on every micro-batch",
                    ),
                )
            elif attr == "zero_grad" and "optim" in owner.lower():
                yield finding(
                    facts,
                    n,
                    "job-manual-step",
                    f"`{ast.unparse(n.func)}()` inside job.steps() clears the gradients the job "
                    "is accumulating over the micro-batches of a window.",
                    "remove it; the job zeroes the gradients after its step.",
                    severity=WARNING,
                )
