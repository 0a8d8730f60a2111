"""The suite's own rules, checked on its source: every test asserts something (directly,
through `pytest.raises`/`fail`/`warns`, or through a helper of the suite that does), and
no assertion measures a duration (a timeout bounds a multi-process test; a time is a
benchmark)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CHECKS = {"raises", "fail", "warns", "deprecated_call", "skip"}
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _suite() -> dict[Path, ast.Module]:
    """Every module of the suite but the doctor's inputs (programs it reads, not tests)."""
    return {p: ast.parse(p.read_text()) for p in TESTS.rglob("*.py") if "doctor_corpus" not in p.parts}


def _called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _checks_directly(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) or (
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and getattr(n.func.value, "id", "") == "pytest" and n.func.attr in CHECKS) for n in ast.walk(fn))


def _asserting_functions(suite: dict[Path, ast.Module]) -> set[str]:
    """Names of the suite's functions that assert, directly or through one that does."""
    defs: dict[str, list[ast.AST]] = {}
    for tree in suite.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(n.name, []).append(n)
    found = {name for name, ds in defs.items() if any(_checks_directly(d) for d in ds)}
    grew = True
    while grew:
        before = len(found)
        found |= {name for name, ds in defs.items() if any(
            isinstance(n, ast.Call) and _called(n) in found for d in ds for n in ast.walk(d))}
        grew = len(found) > before
    return found


def test_every_test_asserts_something():
    suite = _suite()
    asserting = _asserting_functions(suite)
    silent = [f"{p.relative_to(TESTS)}::{n.name}" for p, tree in suite.items() for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
              and n.name not in asserting]
    assert silent == [], f"tests that assert nothing: {silent}"


def _elapsed(node: ast.AST) -> bool:
    """`clock() - start`: a duration. (`clock() < deadline` in a polling loop is a timeout.)"""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and any(
        isinstance(c, ast.Call) and _called(c) in CLOCKS for c in (node.left, node.right))


def test_no_assertion_reads_a_clock():
    timed = [f"{p.relative_to(TESTS)}:{n.lineno}" for p, tree in _suite().items() for n in ast.walk(tree)
             if isinstance(n, ast.Assert) and any(_elapsed(c) for c in ast.walk(n.test))]
    assert timed == [], f"assertions on a wall-clock time: {timed}"


def test_every_test_module_lives_in_a_tier_folder():
    """A test's tier is the folder chosen for what it does (tests/conftest.py TIERS): a
    module left at the top of tests/ has none and is refused at collection."""
    import pytest
    from conftest import TIERS, tier_of

    modules = sorted(TESTS.rglob("test_*.py"))
    assert {tier_of(p) for p in modules} == set(TIERS)
    with pytest.raises(ValueError, match="tier folders"):
        tier_of(TESTS / "test_stray.py")
