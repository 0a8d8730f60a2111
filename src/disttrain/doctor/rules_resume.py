"""Rules about what a resumable checkpoint must hold besides the weights (P-CKPT-1).

A training checkpoint here is a `torch.save` of a dict that holds an optimizer's
state, in a script that also loads one (it resumes). Each check takes `Facts` and
yields `Finding`s; each stays silent unless the source shows the pitfall (a false
positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, arg, mentions, ref
from disttrain.doctor.findings import ADVICE, WARNING, finding, rule

_RNG_CALLS = ("get_rng_state", "get_rng_state_all", "getstate", "get_state", "get_rng_state_tracker")
_RNG_WORDS = ("rng", "random", "generator")
_DATA_WORDS = ("sampler", "loader", "data", "batch", "sample", "iter", "step", "consumed", "offset")


def _checkpoint_items(facts: Facts, call: ast.Call) -> list[tuple[str, ast.AST]] | None:
    """(key, value) pairs of what `torch.save(obj, ...)` writes: a dict literal, or a
    record built with keywords (`Snapshot(model_state=..., optimizer_state=...)`, minGPT),
    inline or assigned to `obj` earlier in the same function (through `asdict(obj)`)."""
    node, before = arg(call, 0, "obj"), call.lineno
    for _ in range(6):  # snapshot = asdict(snapshot) <- snapshot = Snapshot(...)
        if isinstance(node, ast.Dict):
            return [
                (k.value.lower() if isinstance(k, ast.Constant) and isinstance(k.value, str) else "", v)
                for k, v in zip(node.keys, node.values, strict=False)
            ]
        if isinstance(node, ast.Call) and node.keywords and not node.args:
            return [((k.arg or "").lower(), k.value) for k in node.keywords]
        if (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and (facts.qualname(node.func) or "").split(".")[-1] == "asdict"
        ):
            node = node.args[0]
            continue
        name = ref(node) if node is not None else None
        assign = _last_assignment(facts, name, call, before) if name else None
        if assign is None:
            return None
        node, before = assign.value, assign.lineno
    return None


def _last_assignment(facts: Facts, name: str, call: ast.Call, before: int) -> ast.Assign | None:
    """The last `name = ...` above line `before` in `call`'s function."""
    scope = facts.scope_of(call)
    found = [
        n
        for n in facts.nodes
        if isinstance(n, ast.Assign)
        and n.lineno < before
        and facts.scope_of(n) is scope
        and any(ref(t) == name for t in n.targets)
    ]
    return max(found, key=lambda n: n.lineno) if found else None


def _holds_optimizer(items: list[tuple[str, ast.AST]]) -> bool:
    return any("optim" in k for k, _ in items) or any(
        isinstance(v, ast.Call)
        and isinstance(v.func, ast.Attribute)
        and v.func.attr == "state_dict"
        and mentions(v.func.value, lambda w: "optim" in w.lower())
        for _, v in items
    )


def _batch_loop(facts: Facts, call: ast.Call) -> bool:
    """The save sits inside a loop over a data loader: a mid-epoch checkpoint."""
    for a in facts.ancestors(call):
        if isinstance(a, (ast.For, ast.AsyncFor)) and mentions(a.iter, lambda w: "loader" in w.lower()):
            return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    return False


@rule(
    "checkpoint-missing-state",
    ("P-CKPT-1",),
    WARNING,
    "a resumable checkpoint without RNG state or data position",
    """A checkpoint the script resumes from must restore the run, not only the weights:
      with model and optimizer but no RNG state (torch.get_rng_state(),
      torch.cuda.get_rng_state_all(), random/NumPy state), dropout masks and every
      sampler that draws from the global generator differ from the uninterrupted run; saved
      inside the batch loop (mid-epoch) without the data position (the sampler's or
      loader's state, or the step to skip to), a resume restarts the epoch from its first
      batch and trains on those samples twice. Save both, or use a Stateful loader
      (torchdata's StatefulDataLoader) and DCP, which checkpoint them.""",
)
def checkpoint_missing_state(facts: Facts):
    if not facts.calls_to("torch.load", "torch.distributed.checkpoint.load"):
        return  # the script never resumes: an export, not a training checkpoint
    rng_elsewhere = any(facts.method_calls(n) for n in _RNG_CALLS) or any(
        facts.calls_to(f"torch.{n}") for n in _RNG_CALLS
    )
    for call in facts.calls_to("torch.save"):
        items = _checkpoint_items(facts, call)
        if items is None or not _holds_optimizer(items):
            continue
        keys = [k for k, _ in items]
        missing = []
        mid_epoch = _batch_loop(facts, call)
        no_rng = not rng_elsewhere and not any(w in k for k in keys for w in _RNG_WORDS)
        if no_rng:
            missing.append("no RNG state (dropout and any global-generator shuffle restart from the seed)")
        if mid_epoch and not any(w in k for k in keys for w in _DATA_WORDS):
            missing.append(
                "no data position although it is saved mid-epoch (a resume restarts "
                "the epoch from its first batch and repeats the samples already seen)"
            )
        if missing:
            yield finding(
                facts,
                call,
                "checkpoint-missing-state",
                "this training checkpoint holds model and optimizer but " + "; and ".join(missing) + ".",
                "add torch.get_rng_state() / torch.cuda.get_rng_state_all() (and random/"
                "NumPy state) and the sampler or loader position (or the step to skip "
                "to), and restore them on resume.",
                severity=ADVICE if len(missing) == 1 and no_rng and _restarts_at_epoch(facts, mid_epoch) else WARNING,
            )


def _restarts_at_epoch(facts: Facts, mid_epoch: bool) -> bool:
    """Saved between epochs, with an epoch-seeded data order (`sampler.set_epoch(epoch)`
    somewhere in the program): a resume starts the next epoch with the order the
    uninterrupted run would have had; only dropout draws differ, which makes the resume
    inexact, not wrong. The RNG state is then a preference (advice)."""
    return not mid_epoch and any(f.method_calls("set_epoch") for f in facts.project.component(facts))
