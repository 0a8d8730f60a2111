"""Rank guards that do not hold: a test whose `or` part is true on every rank, and a
shared-folder reset with no guard at all before the barrier meant to follow it.

Contract: each function takes the `Facts` of one script and yields `(node, message,
fix)` for the rule that owns it (rules_behaviour's `guard-true-on-every-rank`). Both
look only at what is written: `if is_main and a or b:` is true on every rank whenever
`b` is (Python binds `and` before `or`), whatever the author meant; a folder deleted
with no rank test, right before `barrier()` / `wait_for_everyone()`, is deleted by every
rank while the others may be reading or writing it.
"""

from __future__ import annotations

import ast

from disttrain.doctor import control_flow

# Calls that change or wait on what other ranks share: deleting a folder, asking on the
# terminal (only rank 0's stdin is attached under torchrun), writing a checkpoint.
_SHARED_EFFECTS = {
    "rmtree",
    "remove",
    "unlink",
    "rmdir",
    "removedirs",
    "input",
    "save",
    "save_pretrained",
    "save_state",
    "save_model",
}
_DELETES = {"rmtree", "rmdir", "removedirs"}
_BARRIERS = {"barrier", "wait_for_everyone"}


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _effect(stmts: list[ast.stmt]) -> ast.Call | None:
    """The first call in `stmts` that touches shared state (see _SHARED_EFFECTS)."""
    for s in stmts:
        for n in ast.walk(s):
            if isinstance(n, ast.Call) and _call_name(n) in _SHARED_EFFECTS:
                return n
    return None


def or_precedence(facts):
    """`if <rank test> and a or b:` where `b` tests no rank: the body runs on every rank
    whenever `b` is true. Reported when the body touches shared state."""
    for node in ast.walk(facts.tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.Or)):
            continue
        first, rest = node.test.values[0], node.test.values[1:]
        if not (
            isinstance(first, ast.BoolOp)
            and isinstance(first.op, ast.And)
            and any(control_flow.guard_kind(facts, v) for v in first.values)
        ):
            continue
        free = [v for v in rest if control_flow.guard_kind(facts, v) is None]
        call = _effect(node.body)
        if not free or call is None:
            continue
        yield (
            node,
            f"`{ast.unparse(node.test)[:120]}`: `and` binds before `or`, so the rank test "
            f"covers only the first part; whenever `{ast.unparse(free[0])[:80]}` is true the "
            f"body ({_call_name(call)}() at line {call.lineno}) runs on every rank.",
            "parenthesise the alternatives: `if is_main and (a or b):`.",
        )


def unguarded_reset(facts):
    """A folder deleted (`rmtree`) with no rank guard, in a block whose next statement
    waits for the other ranks: every rank deletes it, while the others may be using it."""
    for call, _ in facts.calls:
        if _call_name(call) not in _DELETES or facts.rank_guard(call) is not None:
            continue
        stmt = _barrier_follows(facts, call)
        if stmt is not None:
            yield (
                call,
                f"{_call_name(call)}() runs on every rank (no rank test around it), then the "
                f"ranks wait for each other (line {stmt.lineno}): each rank deletes the shared "
                "folder, possibly while another has already written to it again.",
                "delete on the main process only, then wait: `if is_main: rmtree(...)` before the barrier.",
            )


def _barrier_follows(facts, node: ast.AST) -> ast.stmt | None:
    """The statement right after the one holding `node` (in its function), when it is a
    bare barrier call."""
    child = node
    for a in facts.ancestors(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(a, field, None)
            if isinstance(block, list) and child in block:
                i = block.index(child)
                nxt = block[i + 1] if i + 1 < len(block) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Call) and _call_name(nxt.value) in _BARRIERS:
                    return nxt
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return None
        child = a
    return None
