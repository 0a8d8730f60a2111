"""Which rank guards stand around a call, and which of them rest on a name alone.

A collective under a rank guard is an error when data flow or a library proves the
guard tests the rank; when the guard rests only on a name (`if rank == 0:` with `rank`
set out of view), the finding is a warning that says what the doctor could not see
(rank_names.named_only). Used by the rules of rules_sync.
"""

from __future__ import annotations

import ast

from disttrain.doctor import control_flow, rank_names
from disttrain.doctor.facts import Facts


def guarding_ifs(facts: Facts, node: ast.AST) -> list[tuple[ast.If, bool]]:
    """The `if`s testing the rank around `node` in its function, innermost first, with the
    branch (True: body) it sits in. `if local_rank != -1` asks "distributed at all?", the
    same answer on every rank, and is no guard."""
    out, child = [], node
    for a in facts.ancestors(node):
        if (
            isinstance(a, ast.If)
            and child is not a.test
            and control_flow.is_rank_test(facts, a.test)
            and not is_distributed_check(a.test)
        ):
            out.append((a, child in a.body))
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            break
        child = a
    return out


def is_distributed_check(test: ast.AST) -> bool:
    """`args.local_rank != -1` / `== -1`: a comparison with -1 only."""
    if not isinstance(test, ast.Compare) or len(test.comparators) != 1:
        return False
    c = test.comparators[0]
    return (
        isinstance(c, ast.UnaryOp)
        and isinstance(c.op, ast.USub)
        and isinstance(c.operand, ast.Constant)
        and c.operand.value == 1
    )


def unseen_note(name: str | None) -> str:
    return (
        f" The doctor takes `{name}` for a rank from its name alone: it cannot see where its value is set."
        if name
        else ""
    )


def named_exit(facts: Facts, node: ast.AST) -> str | None:
    """Like `named_guard` for the early exits before `node` in its function (`if rank !=
    0: return` ... collective): the name they rest on when every one is a name alone."""
    named = [rank_names.named_only(facts, t) for t in exit_tests(facts, node)]
    return named[0] if named and all(named) else None


def exit_tests(facts: Facts, node: ast.AST) -> list[ast.AST]:
    """The rank tests of the `if`s before `node`, in its function's enclosing blocks, whose
    branch ends in an exit (`return`, `raise`, `continue`, `break`, `sys.exit()`)."""
    tests: list[ast.AST] = []
    child = node
    for a in facts.ancestors(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(a, field, None)
            if isinstance(block, list) and child in block:
                tests += [
                    s.test
                    for s in block[: block.index(child)]
                    if isinstance(s, ast.If)
                    and control_flow.ends_in_exit(s.body)
                    and control_flow.is_rank_test(facts, s.test)
                ]
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            break
        child = a
    return tests


def named_guard(facts: Facts, node: ast.AST, depth: int = 2) -> str | None:
    """The name the rank guard around `node` rests on when every guard is a name alone
    (rank_names.named_only): the `if`s around it in its function (or, with none, the early
    exits before it), or else those around
    every call site of that function. None when some guard is proven by data flow."""
    ifs = guarding_ifs(facts, node)
    tests = [i.test for i, _ in ifs] or exit_tests(facts, node)
    if tests:
        named = [rank_names.named_only(facts, t) for t in tests]
        return named[0] if all(named) else None
    fn = facts.scope_of(node)
    sites = facts.project.call_sites.get(fn, []) if depth else []
    names = [named_guard(f, c, depth - 1) for f, c in sites]
    return names[0] if names and all(names) else None
