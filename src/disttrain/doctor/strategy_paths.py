"""Which strategy a path runs: a rule about one strategy (FSDP1's clip, its scaler) fires
only where that strategy can be the one in use.

Contract: `off_strategy(facts, node, wraps)` takes a statement and the program's wraps
of one strategy, as (facts, Wrap) pairs, and says whether no pass that runs `node` can
run under any of them. A wrap and the node are apart when they sit in different branches
of one if/elif/else chain (control_flow.exclusive), or when the node sits under a test
that one of the wrap's tests contradicts: the same mode test (`engine == "torch_ddp"`,
`args.fsdp`, compared by its last name, so `self.engine` in a method meets `args.engine`
in the set-up) taken the other way. Tests are taken to mean the same thing wherever the
same name is compared with the same value: a guess the doctor makes only to stay silent.
Inside a branch each part of an `and` test holds, and a flag bound once in the function
stands for its value (`ddp_mode = args.rank != -1` ... `if ddp_mode:`); a test of the
rank that tells one process from many (`args.rank == -1`) is a mode like the others.
`apart(facts, a, b)` asks the same of two statements of one file (DataParallel and DDP).
"""

from __future__ import annotations

import ast

from disttrain.doctor import control_flow
from disttrain.doctor.names import FUNCTION_NODES, word


def off_strategy(facts, node: ast.AST, wraps: list) -> bool:
    """True when every wrap in `wraps` is on a path apart from `node`'s; False with none."""
    if not wraps:
        return False
    here = _conditions(facts, node)
    return all(_apart(facts, node, here, f, w) for f, w in wraps)


def apart(facts, a: ast.AST, b: ast.AST) -> bool:
    """No pass runs both `a` and `b`: different branches of one chain, or opposite
    answers to one mode test on their ways."""
    if control_flow.exclusive(facts, a, b):
        return True
    there = _conditions(facts, b)
    return any(key in there and there[key] != side for key, side in _conditions(facts, a).items())


def _apart(facts, node: ast.AST, here: dict, f, w) -> bool:
    if f is facts and control_flow.exclusive(facts, node, w.call):
        return True
    if _overridden_where_wrapped(facts, node, f, w):
        return True
    there = _conditions(f, w.call)
    return any(key in there and there[key] != side for key, side in here.items())


def _overridden_where_wrapped(facts, node: ast.AST, f, w) -> bool:
    """`node` is in a method of a base class, and the wrap is made in a subclass that
    overrides that method (on its way down from the base): objects of the subclass,
    the only ones wrapped so, never run the base's method."""
    method = _enclosing(facts, node, FUNCTION_NODES)
    base = _enclosing(facts, node, (ast.ClassDef,))
    sub = _enclosing(f, w.call, (ast.ClassDef,))
    if method is None or base is None or sub is None or sub is base:
        return False
    classes = facts.project.classes
    line = _line_to(classes, sub.name, base.name)
    return bool(line) and any(_defines(classes, c, method.name) for c in line)


def _enclosing(facts, node: ast.AST, kinds: tuple):
    return next((a for a in facts.ancestors(node) if isinstance(a, kinds)), None)


def _line_to(classes: dict, sub: str, base: str) -> list[str]:
    """The classes from `sub` up to `base` (base excluded), or [] when `base` is not
    among its ancestors in view."""
    todo, seen = [[sub]], set()
    while todo:
        path = todo.pop()
        if path[-1] == base:
            return path[:-1]
        for _, c in classes.get(path[-1], []):
            for b in c.bases:
                name = ast.unparse(b).split(".")[-1]
                if name not in seen:
                    seen.add(name)
                    todo.append([*path, name])
    return []


def _defines(classes: dict, name: str, method: str) -> bool:
    return any(isinstance(d, FUNCTION_NODES) and d.name == method for _, c in classes.get(name, []) for d in c.body)


def _conditions(facts, node: ast.AST) -> dict[str, bool]:
    """Each mode test around `node` (its normal form) -> the branch `node` is on."""
    out: dict[str, bool] = {}
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, (ast.If, ast.IfExp)) and child is not a.test:
            in_body = child is a.body or (isinstance(a.body, list) and child in a.body)
            for key, truth in _held(facts, a.test, in_body, 3):
                out.setdefault(key, truth)
        child = a
    return out


def _held(facts, test: ast.AST, true: bool, depth: int) -> list[tuple[str, bool]]:
    """(mode test, its answer) pairs known where `test` answered `true`: every part of an
    `and` that held, a flag bound once in the function followed to its value."""
    if depth and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [p for v in test.values for p in _held(facts, v, True, depth)] if true else []
    out = []
    value = _bound_once(facts, test) if depth and isinstance(test, ast.Name) else None
    if value is not None:
        out = _held(facts, value, true, depth - 1)
    key, flip = _normal(test)
    if key is None or (control_flow.guard_kind(facts, test) and not control_flow.distributed_test(test)):
        return out  # a rank guard splits the ranks of one run, not the modes
    return [(key, true != flip), *out]


def _bound_once(facts, name: ast.Name) -> ast.AST | None:
    """The value of the one plain assignment to `name` in its function, or None."""
    scope = facts.scope_of(name)
    values = [
        n.value
        for n in ast.walk(scope)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name.id for t in n.targets)
        and facts.scope_of(n) is scope
    ]
    return values[0] if len(values) == 1 else None


def _normal(test: ast.AST) -> tuple[str | None, bool]:
    """(`engine == 'torch_ddp'`, negated?) for a test of one name against a constant, or
    a flag's truth (`args.fsdp` -> `fsdp`); None for anything else."""
    flip = False
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, flip = test.operand, not flip
    if isinstance(test, (ast.Name, ast.Attribute)):
        return word(test), flip
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
        and isinstance(test.left, (ast.Name, ast.Attribute))
        and _constant(test.comparators[0]) is not _NO_VALUE
    ):
        flip ^= isinstance(test.ops[0], ast.NotEq)
        return f"{word(test.left)} == {_constant(test.comparators[0])!r}", flip
    return None, False


_NO_VALUE = object()


def _constant(node: ast.AST) -> object:
    """A constant's value, `-1` included (a unary minus on a number)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        v = node.operand.value
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else _NO_VALUE
    return node.value if isinstance(node, ast.Constant) else _NO_VALUE
