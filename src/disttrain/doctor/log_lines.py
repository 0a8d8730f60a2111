"""Which log lines are meant to come from every rank: the ones that name the process
(its rank, pid, SLURM ids) and each rank's own error reports (the unguarded-log rule asks)."""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, mentions


def is_rank_word(word: str) -> bool:
    return "rank" in word.lower()


_OWN_IDS = ("gpu_id", "getpid", "proc_id", "local_id", "node_id", "process_index", "process_id")


def _names_own_id(w: str) -> bool:
    return is_rank_word(w) or w in _OWN_IDS


def per_rank_message(facts: Facts, call: ast.Call) -> bool:
    """The line names this process (its rank, pid, SLURM ids): in an f-string or a
    format, as a %-argument of a logger call (`logger.info("rank=%s", cfg.local_rank)`),
    as one of print's own arguments (`print("Rank", cfg.rank, "batch", n)`: print writes
    them all), or in a message variable built so (`log_str += ' rank {}'.format(rank)`)."""
    args = list(call.args)
    printf = bool(args) and isinstance(args[0], ast.Constant) and "%" in str(args[0].value)
    printed = isinstance(call.func, ast.Name) and call.func.id == "print"
    for i, a in enumerate(args):
        if isinstance(a, (ast.JoinedStr, ast.BinOp, ast.Call)) or (printf and i > 0) or printed:
            if mentions(a, _names_own_id):
                return True
        if any(isinstance(n, ast.Name) and _built_with_own_id(facts, call, n.id) for n in ast.walk(a)):
            return True  # `device = f"cuda:{ddp_local_rank}"` ... print(f"using device: {device}")
    return False


def _built_with_own_id(facts: Facts, call: ast.Call, name: str) -> bool:
    scope = facts.scope_of(call)
    for n in facts.nodes:
        if (
            isinstance(n, (ast.Assign, ast.AugAssign))
            and n.lineno < call.lineno
            and facts.scope_of(n) is scope
            and not facts.exclusive(n, call)
        ):  # not the other branch's value
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and mentions(n.value, _names_own_id):
                return True
    return False


def error_report(facts: Facts, call: ast.Call) -> bool:
    """A print that reports this rank's own failure (a file it could not read), not a line
    every rank repeats: its text starts with "Error" or "Failed", or it sits in an `except`
    handler that carries on (no re-raise) and names the exception or starts with "Warning"."""
    first = call.args[0] if call.args else None
    text = (
        first.value
        if isinstance(first, ast.Constant)
        else first.values[0].value
        if (isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant))
        else None
    )
    text = text.lstrip().lower() if isinstance(text, str) else ""
    if text.startswith(("error", "failed")) or _exits_after(facts, call):
        return True
    handler = next((a for a in facts.ancestors(call) if isinstance(a, ast.ExceptHandler)), None)
    if handler is None or any(isinstance(n, ast.Raise) for n in ast.walk(handler)):
        return False
    return text.startswith("warning") or (
        handler.name is not None
        and any(isinstance(n, ast.Name) and n.id == handler.name for a in call.args for n in ast.walk(a))
    )


_EXITS = ("exit", "sys.exit", "quit", "os._exit")


def _exits_after(facts: Facts, call: ast.Call) -> bool:
    """The print's block ends by stopping the process with a failure (`exit(1)`,
    `sys.exit(...)`, `return -1`): an error report just before this rank stops."""
    stmt = facts.parents.get(call)
    parent = facts.parents.get(stmt) if stmt is not None else None
    block = next((getattr(parent, f) for f in ("body", "orelse") if stmt in (getattr(parent, f, None) or [])), None)
    last = block[-1] if block else None
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):  # a failure status, not quit()
        c = last.value
        return (
            ast.unparse(c.func) in _EXITS
            and bool(c.args)
            and not (isinstance(c.args[0], ast.Constant) and c.args[0].value in (0, None))
        )
    return isinstance(last, ast.Return) and isinstance(last.value, ast.UnaryOp) and isinstance(last.value.op, ast.USub)
