"""Code no run executes, whose findings would describe runs that cannot happen.

Contract: `dead_lines(facts)` gives the line ranges (first, last) of a file that no run
reaches: the body of an `if` whose test is false whatever the values (`if False and
...:`, `if 0:`), the `else` of one that is always true, a function or class defined again
later in the same block with nothing between reading the first (only the last definition
is ever called), and a branch that runs only when a value that is never None is None
(`nullness.impossible`). The analyzer drops the findings that fall in them.
"""

from __future__ import annotations

import ast

from disttrain.doctor import nullness

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def dead_lines(facts) -> list[tuple[int, int]]:
    cache = facts.__dict__
    if "_dead_lines" not in cache:
        cache["_dead_lines"] = _constant_branches(facts) + _shadowed(facts) + _none_branches(facts)
    return cache["_dead_lines"]


def is_dead(facts, line: int) -> bool:
    return any(first <= line <= last for first, last in dead_lines(facts))


def _span(block: list[ast.stmt]) -> list[tuple[int, int]]:
    return [(block[0].lineno, block[-1].end_lineno or block[-1].lineno)] if block else []


def _constant_branches(facts) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in facts.nodes:
        if isinstance(n, ast.If):
            truth = constant_truth(n.test)
            if truth is False:
                out += _span(n.body)
            elif truth is True:
                out += _span(n.orelse)
    return out


def constant_truth(test: ast.AST) -> bool | None:
    """The test's truth when no value can change it (`False and x` is False), else None."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = constant_truth(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        truths = [constant_truth(v) for v in test.values]
        decisive = isinstance(test.op, ast.Or)  # `or` is decided by a True part, `and` by a False one
        if decisive in truths:
            return decisive
        return None if None in truths else not decisive
    return None


def _shadowed(facts) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in facts.nodes:
        if isinstance(n, (ast.Module, ast.ClassDef)):
            out += _shadowed_in(n.body)
    return out


def _shadowed_in(body: list[ast.stmt]) -> list[tuple[int, int]]:
    out = []
    for i, d in enumerate(body):
        if not isinstance(d, _DEFS):
            continue
        for j in range(i + 1, len(body)):
            later = body[j]
            if isinstance(later, _DEFS) and later.name == d.name:
                if not _reads(body[i + 1 : j], d.name) and not _reads(later.decorator_list, d.name):
                    first = min([d.lineno, *(x.lineno for x in d.decorator_list)])
                    out.append((first, d.end_lineno or d.lineno))
                break
            if _rebinds(later, d.name):
                break
    return out


def _reads(nodes: list, name: str) -> bool:
    """`name` is read by the statements themselves (not inside the functions they define:
    those run later, when the last definition is the one bound)."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and n.id == name:
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += [*getattr(n, "decorator_list", []), *n.args.defaults, *n.args.kw_defaults]
            continue
        todo += [c for c in ast.iter_child_nodes(n) if c is not None]
    return False


def _rebinds(stmt: ast.stmt, name: str) -> bool:
    """Anything else binds `name` between the two definitions (an import, an assignment)."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt))


def _none_branches(facts) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in facts.nodes:
        if not isinstance(n, ast.If) or nullness.none_test(n.test) is None:
            continue
        for block in (n.body, n.orelse):
            if block and nullness.impossible(facts, block[0]):
                out += _span(block)
    return out
