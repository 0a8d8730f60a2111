"""Values that are never None: what makes an `if x is None:` branch one no run takes.

Contract: `never_none(facts, expr)` is True only when every value `expr` can have is
shown not to be None; anything the doctor cannot follow (a parameter, an attribute, a
call out of view) may be None. Followed: literals and displays, a call of a class (a
project class, or a capitalised name: a constructor), a call of a project function whose
every `return` gives a value that is never None and whose body cannot fall off its end,
the element of such a returned tuple that `a, b = f()` binds, and a local name whose every
assignment in its function (outside branches no run takes) is such a value. Used by
`dead_code` to drop findings in branches that cannot run.
"""

from __future__ import annotations

import ast

from disttrain.doctor.names import FUNCTION_NODES

_DEPTH = 12  # each name, call or tuple followed takes one or two
_NEVER_NONE_NODES = (
    ast.Tuple,
    ast.List,
    ast.Dict,
    ast.Set,
    ast.ListComp,
    ast.DictComp,
    ast.SetComp,
    ast.GeneratorExp,
    ast.JoinedStr,
    ast.Lambda,
    ast.Compare,
)


def never_none(facts, expr: ast.AST, index: int | None = None, depth: int = _DEPTH) -> bool:
    """`expr` (element `index` of the tuple it gives, when `index` is set) is never None."""
    if depth <= 0:
        return False
    if index is not None:
        if isinstance(expr, ast.Tuple):
            return index < len(expr.elts) and never_none(facts, expr.elts[index], None, depth - 1)
        return isinstance(expr, ast.Call) and _returns_never_none(facts, expr, index, depth - 1)
    if isinstance(expr, ast.Constant):
        return expr.value is not None
    if isinstance(expr, _NEVER_NONE_NODES):
        return True
    if isinstance(expr, ast.IfExp):
        return never_none(facts, expr.body, None, depth - 1) and never_none(facts, expr.orelse, None, depth - 1)
    if isinstance(expr, ast.BoolOp):  # `a or b` gives b when a is falsy; `a and b` gives a falsy a
        values = expr.values[-1:] if isinstance(expr.op, ast.Or) else expr.values
        return all(never_none(facts, v, None, depth - 1) for v in values)
    if isinstance(expr, ast.Call):
        return _constructed(facts, expr) or _returns_never_none(facts, expr, None, depth - 1)
    if isinstance(expr, ast.Name):
        return _name_never_none(facts, expr, depth - 1)
    return False


def _constructed(facts, call: ast.Call) -> bool:
    """A class is called: one of the project's, or a capitalised name that is no project
    function (`DataLoader(...)`, `datasets.CIFAR100(...)`)."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if not name or name in facts.project.classes:
        return bool(name)
    return name[:1].isupper() and name not in facts.project.defs


def _returns_never_none(facts, call: ast.Call, index: int | None, depth: int) -> bool:
    """Every project function `call` may reach returns a never-None value on every path."""
    defs = facts.project.resolve(facts, call) or _from_package(facts, call)
    return bool(defs) and all(_function_never_none(f, d, index, depth) for f, d in defs)


def _from_package(facts, call: ast.Call) -> list:
    """`from data import build_loader` with data/build.py in view and no data/__init__.py:
    the module-level `build_loader` of a file in that folder (what the missing `__init__`
    re-exports, as far as the doctor can tell)."""
    from pathlib import PurePath

    if not isinstance(call.func, ast.Name):
        return []
    name = call.func.id
    package = next(
        (
            n.module
            for n in facts.tree.body
            if isinstance(n, ast.ImportFrom)
            and n.module
            and not n.level
            and any(a.name == name and not a.asname for a in n.names)
        ),
        None,
    )
    if package is None:
        return []
    folder = package.replace(".", "/")
    inits = {PurePath(f.path).parent.as_posix() for f in facts.project.files if PurePath(f.path).stem == "__init__"}
    return [
        (f, d)
        for f, d in facts.project.defs.get(name, [])
        if f.parents.get(d) is f.tree
        and PurePath(f.path).parent.as_posix().endswith("/" + folder)
        and PurePath(f.path).parent.as_posix() not in inits
    ]


def _function_never_none(f, d: ast.AST, index: int | None, depth: int) -> bool:
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(d)) or not _ends(d.body):  # type: ignore[attr-defined]
        return False
    returns = [n for n in f.scoped.get(d, ()) if isinstance(n, ast.Return)]
    return bool(returns) and all(r.value is not None and never_none(f, r.value, index, depth) for r in returns)


def _ends(body: list[ast.stmt]) -> bool:
    """The block never falls off its end: it ends in a return or raise (both branches of
    a final if/else, every handler of a final try)."""
    last = body[-1] if body else None
    if isinstance(last, (ast.Return, ast.Raise)):
        return True
    if isinstance(last, ast.If):
        return _ends(last.body) and _ends(last.orelse)
    if isinstance(last, ast.Try):
        return (_ends(last.body) or _ends(last.orelse)) and all(_ends(h.body) for h in last.handlers)
    return False


def _name_never_none(facts, name: ast.Name, depth: int) -> bool:
    scope = facts.scope_of(name)
    if not isinstance(scope, FUNCTION_NODES):
        return False  # a module's name may be rebound by any function (`global`)
    if any(a.arg == name.id for a in (*scope.args.args, *scope.args.kwonlyargs, *scope.args.posonlyargs)):
        return False
    found = 0
    for n in ast.walk(scope):
        if facts.scope_of(n) is not scope:
            continue
        if isinstance(n, (ast.Global, ast.Nonlocal)) and name.id in n.names:
            return False
        for target, value, index in _bindings(n):
            if not (isinstance(target, ast.Name) and target.id == name.id):
                continue
            if impossible(facts, n, depth):
                continue
            if value is None or not never_none(facts, value, index, depth):
                return False
            found += 1
    return found > 0


def _bindings(n: ast.AST) -> list[tuple[ast.AST, ast.AST | None, int | None]]:
    """(target, value, tuple index) for what a statement binds; value None when unknown
    (a loop variable, a `with ... as`, an augmented or annotated-only assignment)."""
    if isinstance(n, ast.Assign):
        out: list = []
        for t in n.targets:
            if isinstance(t, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in t.elts):
                out += [(e, n.value, i) for i, e in enumerate(t.elts)]
            else:
                out.append((t, n.value, None))
        return out
    if isinstance(n, ast.AnnAssign):
        return [(n.target, n.value, None)]
    if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
        return [(e, None, None) for e in ast.walk(n.target)]
    if isinstance(n, ast.withitem) and n.optional_vars is not None:
        return [(e, None, None) for e in ast.walk(n.optional_vars)]
    if isinstance(n, ast.NamedExpr):
        return [(n.target, n.value, None)]
    if isinstance(n, ast.AugAssign):
        return [(n.target, n.target, None)]  # `x += 1` keeps x as it was: not None if it was not
    return []


def impossible(facts, node: ast.AST, depth: int = _DEPTH) -> bool:
    """`node` sits in the branch of `if x is None:` (or the else of `if x is not None:`)
    where `x` is never None: no run reaches it."""
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, ast.If) and child is not a.test:
            side = none_test(a.test)
            if side is not None and (child in a.body) == side[1] and never_none(facts, side[0], None, depth):
                return True
        if isinstance(a, FUNCTION_NODES):
            return False
        child = a
    return False


def none_test(test: ast.AST) -> tuple[ast.Name, bool] | None:
    """(x, True) for `x is None` / `x == None`, (x, False) for `x is not None` / `x != None`."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)):
        return None
    right, op = test.comparators[0], test.ops[0]
    if not (isinstance(right, ast.Constant) and right.value is None):
        return None
    if isinstance(op, (ast.Is, ast.Eq)):
        return test.left, True
    if isinstance(op, (ast.IsNot, ast.NotEq)):
        return test.left, False
    return None
