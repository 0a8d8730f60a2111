"""Rules about what a resumable checkpoint must hold besides the weights (P-CKPT-1).

A training checkpoint here is a `torch.save` of a dict that holds an optimizer's
state, in a script that also loads one (it resumes). Each check takes `Facts` and
yields `Finding`s; each stays silent unless the source shows the pitfall (a false
positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, arg, mentions, ref
from disttrain.doctor.findings import WARNING, finding, rule

_RNG_CALLS = ("get_rng_state", "get_rng_state_all", "getstate", "get_state", "get_rng_state_tracker")
_RNG_WORDS = ("rng", "random", "generator")
_DATA_WORDS = ("sampler", "loader", "data", "batch", "sample", "iter", "step", "consumed", "offset")


def _checkpoint_dict(facts: Facts, call: ast.Call) -> ast.Dict | None:
    """The dict literal saved by `torch.save(obj, ...)`: inline, or the last assignment
    of `obj` before the save in the same function."""
    obj = arg(call, 0, "obj")
    if isinstance(obj, ast.Dict):
        return obj
    name = ref(obj) if obj is not None else None
    if not name:
        return None
    scope = facts.scope_of(call)
    found = None
    for n in facts.nodes:
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) and n.lineno <= call.lineno and \
                facts.scope_of(n) is scope and any(ref(t) == name for t in n.targets):
            if found is None or n.lineno > found.lineno:
                found = n
    return found.value if found is not None else None


def _keys(d: ast.Dict) -> list[str]:
    return [k.value.lower() for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def _holds_optimizer(d: ast.Dict) -> bool:
    return any("optim" in k for k in _keys(d)) or any(
        isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "state_dict"
        and mentions(v.func.value, lambda w: "optim" in w.lower()) for v in d.values)


def _batch_loop(facts: Facts, call: ast.Call) -> bool:
    """The save sits inside a loop over a data loader: a mid-epoch checkpoint."""
    for a in facts.ancestors(call):
        if isinstance(a, (ast.For, ast.AsyncFor)) and mentions(a.iter, lambda w: "loader" in w.lower()):
            return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
    return False


@rule("checkpoint-missing-state", ("P-CKPT-1",), WARNING,
      "a resumable checkpoint without RNG state or data position",
      """A checkpoint the script resumes from must restore the run, not only the weights:
      with model and optimizer but no RNG state (torch.get_rng_state(),
      torch.cuda.get_rng_state_all(), random/NumPy state), dropout masks and every
      sampler that draws from the global generator differ from the uninterrupted run; saved
      inside the batch loop (mid-epoch) without the data position (the sampler's or
      loader's state, or the step to skip to), a resume restarts the epoch from its first
      batch and trains on those samples twice. Save both, or use a Stateful loader
      (torchdata's StatefulDataLoader) and DCP, which checkpoint them.""")
def checkpoint_missing_state(facts: Facts):
    if not facts.calls_to("torch.load", "torch.distributed.checkpoint.load"):
        return  # the script never resumes: an export, not a training checkpoint
    rng_elsewhere = any(facts.method_calls(n) for n in _RNG_CALLS) or \
        any(facts.calls_to(f"torch.{n}") for n in _RNG_CALLS)
    for call in facts.calls_to("torch.save"):
        d = _checkpoint_dict(facts, call)
        if d is None or not _holds_optimizer(d):
            continue
        keys = _keys(d)
        missing = []
        if not rng_elsewhere and not any(w in k for k in keys for w in _RNG_WORDS):
            missing.append("no RNG state (dropout and any global-generator shuffle restart "
                           "from the seed)")
        if _batch_loop(facts, call) and not any(w in k for k in keys for w in _DATA_WORDS):
            missing.append("no data position although it is saved mid-epoch (a resume restarts "
                           "the epoch from its first batch and repeats the samples already seen)")
        if missing:
            yield finding(facts, call, "checkpoint-missing-state",
                          "this training checkpoint holds model and optimizer but " +
                          "; and ".join(missing) + ".",
                          "add torch.get_rng_state() / torch.cuda.get_rng_state_all() (and random/"
                          "NumPy state) and the sampler or loader position (or the step to skip "
                          "to), and restore them on resume.",
                          severity=WARNING)
