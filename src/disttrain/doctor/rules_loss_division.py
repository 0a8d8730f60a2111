"""The loss divided by the accumulation count exactly once (`loss-divided-twice`).

With gradient accumulation each micro-batch's loss is divided by the window once. The
division can hide in the loss function, in an `x /= accum` before the backward, or in a
library's backward: disttrain's Accumulator and dt.Job (`job.backward` divides by
accum_steps), Accelerate's `accelerator.backward` with `gradient_accumulation_steps`,
Lightning's automatic optimization. A second one makes every gradient accum_steps times
too small. The check takes `Facts` and yields `Finding`s.
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, kwarg, mentions, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, path_witness, rule
from disttrain.doctor.rules_job import job_windows

_ACCUM_WORDS = ("accum", "grad_acc", "gradient_acc", "ga_steps")
Site = ast.expr | ast.stmt  # where a loss is divided: `x / k`, `loss /= k`, a call that divides


def is_accum_word(word: str) -> bool:
    low = word.lower()
    return any(w in low for w in _ACCUM_WORDS)


def _divisions(node: ast.AST) -> list[Site]:
    """Divisions by an accumulation count inside `node`: `x / accum_steps`."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and mentions(n.right, is_accum_word)
    ]


def _returns_divided(facts: Facts, name: str) -> bool:
    for d in facts.functions.get(name, []):
        for n in ast.walk(d):
            if isinstance(n, ast.Return) and n.value is not None and _divisions(n.value):
                return True
    return False


@rule(
    "loss-divided-twice",
    ("P-DDP-5",),
    ERROR,
    "loss divided by the accumulation steps twice",
    """With gradient accumulation the loss is divided by the number of micro-steps
      exactly once. Dividing twice (in the loss function and again before backward, or
      `loss /= accum` then `(loss / accum).backward()`) shrinks every gradient by that
      factor again: an effective learning rate accum_steps times too small. A dt.Job
      built with accum_steps (like disttrain's Accumulator) divides in job.backward(loss):
      inside job.steps() the script's own division is the second one.""",
)
def loss_divided_twice(facts: Facts):
    accumulators = _accumulator_names(facts)
    windows = job_windows(facts)
    for bw in facts.method_calls("backward"):
        receiver = bw.func.value  # type: ignore[attr-defined]
        # accelerator.backward(loss) / acc.backward(loss) / loss.backward()
        target = bw.args[0] if bw.args else receiver
        # scaler.scale(loss).backward()
        if (
            isinstance(target, ast.Call)
            and isinstance(target.func, ast.Attribute)
            and target.func.attr == "scale"
            and target.args
        ):
            target = target.args[0]
        sites = list(_divisions(target))
        if bw.args and ref(receiver) in accumulators:
            sites.append(bw)  # disttrain's Accumulator.backward divides by accum_steps itself
        name = _loss_name(target)
        if name:
            sites += _assign_divisions(facts, bw, name)
        job = ref(receiver) if bw.args else None
        if job in windows and sites:
            yield _divided_before_job(facts, sites, bw, windows[job])
            continue
        if len(sites) >= 2:
            second = sorted(sites, key=lambda n: (n.lineno, n.col_offset))[1]
            yield finding(
                facts,
                second,
                "loss-divided-twice",
                f"the loss is divided by the accumulation steps {len(sites)} times before "
                "backward(): gradients end up accum_steps times too small.",
                "divide exactly once, right before backward().",
                witness=path_witness(
                    facts,
                    [("a division by the accumulation steps", s) for s in sorted(sites, key=lambda n: n.lineno)]
                    + [("backward()", bw)],
                    "gradients accum_steps times too small",
                ),
            )
    for div in _lightning_divisions(facts):
        yield finding(
            facts,
            div,
            "loss-divided-twice",
            "training_step returns the loss divided by the accumulation steps, and "
            "Lightning divides it by accumulate_grad_batches again before backward(): "
            "gradients end up accumulate_grad_batches times too small.",
            "return the plain loss; Lightning scales it for accumulation itself.",
            witness=path_witness(
                facts,
                [("training_step divides the loss", div)],
                "Lightning divides it by accumulate_grad_batches again before backward()",
            ),
        )


def _divided_before_job(facts: Facts, sites: list[Site], bw: ast.Call, steps: ast.expr):
    """The script's own division of a loss that `job.backward` (of a Job with accum_steps
    `steps`) divides again. An error when the window is a constant above 1, or the script
    divides by the very expression the Job was given (a no-op at 1, wrong above it); a
    warning when the doctor cannot see the window's value."""
    first = sorted(sites, key=lambda n: (n.lineno, n.col_offset))[0]
    window = ast.unparse(steps)
    divisor = first.right if isinstance(first, ast.BinOp) else first.value if isinstance(first, ast.AugAssign) else None
    proven = (isinstance(steps, ast.Constant) and isinstance(steps.value, int) and steps.value > 1) or (
        divisor is not None and ast.unparse(divisor) == window
    )
    seen = (
        "" if proven else (f" The doctor cannot see the value of `{window}`: if it is 1 the division changes nothing.")
    )
    return finding(
        facts,
        first,
        "loss-divided-twice",
        f"job.backward() (line {bw.lineno}) divides the loss by accum_steps ({window}) itself; "
        "this division inside job.steps() is a second one: the gradients and the logged loss "
        f"come out accum_steps times too small.{seen}",
        "remove the script's own division and pass the plain loss to job.backward() and job.log().",
        severity=ERROR if proven else WARNING,
        witness=path_witness(
            facts,
            [("the script divides the loss", first), ("job.backward() divides it again", bw)],
            "gradients too small",
        )
        if proven
        else "",
    )


def _accumulator_names(facts: Facts) -> set[str]:
    """Names bound to `disttrain.Accumulator(...)` or to an Accelerate
    `Accelerator(gradient_accumulation_steps=N)`: their backward() divides the loss by
    the accumulation steps itself (accelerate's `loss / self.gradient_accumulation_steps`)."""
    out = set()
    makers = facts.calls_to(
        "disttrain.Accumulator",
        "disttrain.train.accumulation.Accumulator",
        "disttrain.loop.Accumulator",
    )
    makers += [
        c
        for c in facts.calls_to("accelerate.Accelerator")
        if (k := kwarg(c, "gradient_accumulation_steps")) is not None and not _is_one(k)
    ]
    for call in makers:
        parent = facts.parents.get(call)
        if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and (r := ref(parent.targets[0])):
            out.add(r)
    return out


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 1


def _lightning_divisions(facts: Facts):
    """Divisions by the accumulation count in a LightningModule's training_step return:
    under automatic optimization Lightning divides the returned loss by
    accumulate_grad_batches itself (ClosureResult.from_training_step_output)."""
    if any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "automatic_optimization" for t in n.targets)
        for n in facts.nodes
    ):
        return
    for cls in facts.nodes:
        if not isinstance(cls, ast.ClassDef) or not any(
            (facts.qualname(b) or "").endswith("LightningModule") for b in cls.bases
        ):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "training_step":
                for n in ast.walk(fn):
                    if isinstance(n, ast.Return) and n.value is not None:
                        yield from _divisions(n.value)


def _loss_name(expr: ast.AST) -> str | None:
    """The variable a backward() target is computed from: `(loss / k).backward()` ->
    loss, `loss.mean().backward()` -> loss."""
    while True:
        if isinstance(expr, ast.BinOp):
            expr = expr.left
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            expr = expr.func.value
        else:
            return expr.id if isinstance(expr, ast.Name) else None


def _assign_divisions(facts: Facts, bw: ast.Call, name: str) -> list[Site]:
    """Divisions applied to `name` by assignments that certainly run before `bw`: the
    statements before it in each enclosing block, up to its loop or function. Other
    branches of an `if` (the no_sync micro-step vs the boundary step) are skipped."""
    out: list[Site] = []
    child: ast.AST = bw
    for a in facts.ancestors(bw):
        for block in _blocks(a):
            if child in block:
                for stmt in block[: block.index(child)]:
                    out += _stmt_divisions(facts, stmt, name)
        if isinstance(a, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef)):
            break
        child = a
    return out


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [b for f in ("body", "orelse", "finalbody") if isinstance(b := getattr(node, f, None), list)]


def _stmt_divisions(facts: Facts, stmt: ast.stmt, name: str) -> list[Site]:
    if (
        isinstance(stmt, ast.AugAssign)
        and isinstance(stmt.op, ast.Div)
        and ref(stmt.target) == name
        and mentions(stmt.value, is_accum_word)
    ):
        return [stmt]
    if isinstance(stmt, ast.Assign) and any(ref(t) == name for t in stmt.targets):
        out = list(_divisions(stmt.value))
        for c in ast.walk(stmt.value):  # loss = compute_loss(...) that already divides
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and _returns_divided(facts, c.func.id):
                out.append(c)
        return out
    if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):  # runs unconditionally
        return [d for s in stmt.body for d in _stmt_divisions(facts, s, name)]
    return []
