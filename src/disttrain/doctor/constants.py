"""Constant arguments, followed into the project functions they parameterise.

A loader factory called as `build_loader("val", rank=-1)` on rank 0 only wraps its work
in `with leader_prepares_first(rank):`, a context manager whose barriers run only when
`rank not in (-1, 0)` or `rank == 0`. With -1 bound, neither runs, so nothing waits for
the other ranks. `reached_collective(project, facts, call)` walks the callee with the
call's constant arguments (and the defaults it leaves in place), keeps only the branches
those constants allow, follows the calls and context managers it meets the same way, and
answers which collective the call reaches and whether on every path.

Contract: read-only over the trees. A test it cannot decide keeps both branches and makes
what lies under them conditional, so it never drops a collective some value could reach.
Callees that get no constant fall back to `Project.collective_functions`.
"""

from __future__ import annotations

import ast
import operator

from disttrain.doctor.names import FUNCTION_NODES

_UNKNOWN = object()
_DEPTH = 8  # calls deep; each (function, constants, depth) is walked once
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def value(node: ast.AST, env: dict):
    """The value of a constant expression under `env` (name -> value), or _UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env.get(node.id, _UNKNOWN)
    if isinstance(node, ast.UnaryOp):
        v = value(node.operand, env)
        if v is _UNKNOWN:
            return _UNKNOWN
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.USub) and isinstance(v, (int, float)):
            return -v
        return _UNKNOWN
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [value(e, env) for e in node.elts]
        return _UNKNOWN if any(i is _UNKNOWN for i in items) else tuple(items)
    if isinstance(node, ast.Compare):
        return _compare(node, env)
    if isinstance(node, ast.BoolOp):
        return truth(node, env)
    return _UNKNOWN


def _compare(node: ast.Compare, env: dict):
    left = value(node.left, env)
    for op, right_node in zip(node.ops, node.comparators, strict=False):
        right = value(right_node, env)
        fn = _COMPARE.get(type(op))
        if left is _UNKNOWN or right is _UNKNOWN or fn is None:
            return _UNKNOWN
        try:
            if not fn(left, right):
                return False
        except TypeError:
            return _UNKNOWN
        left = right
    return True


def truth(node: ast.AST, env: dict) -> bool | None:
    """Whether a test is true under `env`; None when the constants do not decide it."""
    if isinstance(node, ast.BoolOp):
        parts = [truth(v, env) for v in node.values]
        decisive = isinstance(node.op, ast.Or)  # one true decides an `or`, one false an `and`
        if decisive in parts:
            return decisive
        return None if None in parts else not decisive
    v = value(node, env)
    return None if v is _UNKNOWN else bool(v)


def bind(call: ast.Call, d: ast.AST, env: dict) -> dict:
    """The parameters of `d` that `call` fills with a constant (under the caller's `env`),
    and those it leaves at a constant default. A `*args`/`**kwargs` in the call hides what
    the rest receive, so their defaults are not assumed. Parameters the body assigns again
    are left out."""
    a = d.args  # type: ignore[attr-defined]
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    if params[:1] in (["self"], ["cls"]) and isinstance(call.func, ast.Attribute):
        params = params[1:]
    out: dict = {}
    given: set[str] = set()
    starred = any(isinstance(x, ast.Starred) for x in call.args) or any(k.arg is None for k in call.keywords)
    for p, x in zip(params, call.args, strict=False):
        if isinstance(x, ast.Starred):
            break
        given.add(p)
        out[p] = value(x, env)
    for k in call.keywords:
        if k.arg is not None:
            given.add(k.arg)
            out[k.arg] = value(k.value, env)
    if not starred:
        positional = [p.arg for p in (*a.posonlyargs, *a.args)]
        for p, dv in zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=False):
            if p not in given:
                out[p] = value(dv, {})
        for p, dv in zip(a.kwonlyargs, a.kw_defaults, strict=False):
            if p.arg not in given and dv is not None:
                out[p.arg] = value(dv, {})
    assigned = _assigned_names(d)
    return {k: v for k, v in out.items() if v is not _UNKNOWN and k not in assigned}


def _assigned_names(d: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(d) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def reached_collective(project, facts, call: ast.Call, env: dict | None = None, depth: int = _DEPTH) -> tuple | None:
    """(facts, call, name, unconditional) of the collective `call` reaches with its
    constant arguments followed, or None when no path the constants allow reaches one."""
    best = None
    known = project.collective_functions
    for f, d in project.resolve(facts, call):
        if d not in known:
            continue  # reaches no collective whatever it is given
        bound = bind(call, d, env or {})
        if not bound or depth <= 0:
            hit = known[d]
        else:
            hit = _walk_once(project, f, d, bound, depth - 1)
        best = _better(best, hit)
    return best


def _walk_once(project, f, d: ast.AST, bound: dict, depth: int):
    """`_Walk` of `d` under `bound`, once per (function, bindings) in the run."""
    cache = project.__dict__.setdefault("_constant_walks", {})
    try:
        key = (id(d), frozenset(bound.items()), depth)
        hash(key)
    except TypeError:  # an unhashable constant: walk without the cache
        return _Walk(project, f, depth).block(d.body, bound, False)  # type: ignore[attr-defined]
    if key not in cache:
        cache[key] = None  # a recursive call of `d` under the same bindings adds nothing
        cache[key] = _Walk(project, f, depth).block(d.body, bound, False)  # type: ignore[attr-defined]
    return cache[key]


def call_reaches(project, facts, site: ast.Call, d: ast.AST, target: ast.Call) -> bool:
    """Whether the call `site` of function `d` can reach `target`, a collective written in
    `d` itself, with the constants it passes (`sync(flag=False)` never reaches `if flag:
    dist.barrier()`). True when it passes none."""
    bound = bind(site, d, {})
    if not bound:
        return True
    walk = _Walk(project, facts, 0)
    walk.target = target
    return walk.block(d.body, bound, False) is not None  # type: ignore[attr-defined]


def _better(a, b):
    if a is None or (b is not None and b[3] and not a[3]):
        return b
    return a


class _Walk:
    """One callee's body under constant bindings: the first collective on a path they allow."""

    def __init__(self, project, facts, depth: int):
        self.project, self.facts, self.depth = project, facts, depth
        self.target: ast.Call | None = None  # only this call counts (call_reaches)

    def block(self, stmts: list, env: dict, cond: bool):
        best = None
        for s in stmts:
            if isinstance(s, (*FUNCTION_NODES, ast.ClassDef)):
                continue
            if isinstance(s, ast.If):
                best = _better(best, self.expr(s.test, env, cond))
                t = truth(s.test, env)
                if t is None:
                    best = _better(best, _better(self.block(s.body, env, True), self.block(s.orelse, env, True)))
                    continue
                taken = s.body if t else s.orelse
                best = _better(best, self.block(taken, env, cond))
                if taken and isinstance(taken[-1], (ast.Return, ast.Raise)):
                    return best  # the constants send every call out here
                continue
            for field, v in ast.iter_fields(s):
                if field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    continue
                for x in v if isinstance(v, list) else [v]:
                    if isinstance(x, ast.AST):
                        best = _better(best, self.expr(x, env, cond))
            # a loop's or a with's body runs as its statement does (as in
            # Project.collective_functions); a try's may stop early; an else, a handler or a
            # case runs on some paths only
            best = _better(best, self.block(getattr(s, "body", None) or [], env, cond or isinstance(s, ast.Try)))
            best = _better(best, self.block(getattr(s, "finalbody", None) or [], env, cond))
            for sub in [
                getattr(s, "orelse", None) or [],
                *(h.body for h in getattr(s, "handlers", [])),
                *(c.body for c in getattr(s, "cases", [])),
            ]:
                best = _better(best, self.block(sub, env, True))
            if isinstance(s, (ast.Return, ast.Raise)) and not cond:
                return best
        return best

    def expr(self, node: ast.AST, env: dict, cond: bool):
        """The collective a call inside the expression reaches (branches of a conditional
        expression the constants decide are followed alone)."""
        if isinstance(node, ast.Lambda):
            return None
        if isinstance(node, ast.IfExp):
            t = truth(node.test, env)
            best = self.expr(node.test, env, cond)
            if t is None:
                return _better(best, _better(self.expr(node.body, env, True), self.expr(node.orelse, env, True)))
            return _better(best, self.expr(node.body if t else node.orelse, env, cond))
        if isinstance(node, ast.BoolOp):
            best = self.expr(node.values[0], env, cond)
            for v in node.values[1:]:
                best = _better(best, self.expr(v, env, True))
            return best
        best = None
        for child in ast.iter_child_nodes(node):
            best = _better(best, self.expr(child, env, cond))
        if isinstance(node, ast.Call) and self.target is not None:
            return _better(best, (self.facts, node, "", not cond) if node is self.target else None)
        if isinstance(node, ast.Call):
            name = self.project.call_collective_name(self.facts, node)
            if name:
                return _better(best, (self.facts, node, name, not cond))
            hit = reached_collective(self.project, self.facts, node, env, self.depth)
            if hit is not None:
                hit = (hit[0], hit[1], hit[2], hit[3] and not cond)
            best = _better(best, hit)
        return best
