"""What each rank class runs: the collectives a function issues on rank 0, on another
node's local rank 0 and on the other ranks, and the first point where they differ.

Contract: `witness(facts, scope)` walks one function (or a module's body) once per rank
class and per path, following its `if`s, loops (one pass), `with` bodies, a project
context manager's code around its `yield`, and the project functions it calls that
reach a collective (to a small depth, with their arguments bound). A test of the rank is
decided per class; any other test is taken to answer the same on every rank, and each
answer is tried (a path). It returns `PAIRED` when every class issues the same sequence
of collectives on every path (the "rank 0 first" pattern: the other ranks' barrier
before the body, rank 0's after it), a `Witness` naming the first point where two
classes part, or `UNSEEN` with the reason when a test cannot be decided per class (a
rank compared with something not constant, an object made on one rank only) or the
paths are too many. A raise ends a path without a verdict: the launcher stops the job.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from disttrain.doctor import control_flow, rank_values
from disttrain.doctor.names import FUNCTION_NODES, ref, word
from disttrain.doctor.rank_names import is_local_word

_DEPTH = 8  # project functions followed into, call within call
_WORK = 20_000  # statements walked for one class on one path
_PATHS = 128  # paths tried before giving up (each a set of answers to non-rank tests)
_EXIT_CALLS = ("sys.exit", "exit", "quit", "os._exit")
# Names that hold a rank number, whose truth is `!= 0` (a flag word is true on rank 0).
_FLAG_WORDS = ("main", "master", "zero", "rank0", "rank_0", "leader", "primary", "chief", "first")


@dataclass(frozen=True)
class RankClass:
    """Processes that answer every rank test alike: `rank`/`local` a number, or None
    for "another one" (not 0, not any number a test names)."""

    label: str
    rank: int | None
    local: int | None


@dataclass(frozen=True)
class Step:
    what: str  # a collective's name, or what ends the run ("return", "end of main()")
    path: str
    line: int


@dataclass
class Witness:
    """The first point where two rank classes issue different collectives."""

    text: str


@dataclass(frozen=True)
class Unseen:
    reason: str


PAIRED = "paired"


class _Need(Exception):
    """A test that is not about the rank: try the path with each answer."""

    def __init__(self, key: str):
        self.key = key


class _NewRank(Exception):
    def __init__(self, value: int):
        self.value = value


class _Undecided(Exception):
    def __init__(self, reason: str):
        self.reason = reason


class _Exit(Exception):
    def __init__(self, kind: str, step: Step):
        self.kind, self.step = kind, step


@dataclass
class _Frame:
    facts: object
    fn: ast.AST
    env: dict = field(default_factory=dict)  # parameter -> (caller frame, expression)
    on_yield: object = None
    depth: int = 0


@dataclass
class _Run:
    cls: RankClass
    answers: dict
    known: frozenset = frozenset()  # the numbered ranks that have a class of their own
    events: list[Step] = field(default_factory=list)
    done: dict = field(default_factory=dict)  # (callee, its arguments) -> (steps, how it ended)
    work: int = 0
    reach: tuple | None = None  # (file, line) of the call whose collective is judged
    hit: bool = False  # that call ran on this path


_SITES = 6  # call sites of a guarded function followed


def witness_for(facts, node: ast.AST) -> Witness | Unseen | str:
    """The verdict for a collective (or a call into one) that some ranks may skip: run
    the function around it; when its own code holds no rank guard (the function is
    called only under one), run its callers. A function that parts the ranks is cleared
    when every caller in view pairs them up again."""
    scope = facts.scope_of(node)
    sites = facts.project.call_sites.get(scope, [])[:_SITES] if isinstance(scope, FUNCTION_NODES) else []
    if facts.rank_guard(node, subset=True, local=True) is not None:
        own = witness(facts, scope)
        if not isinstance(own, Witness) or not sites:
            return own
        at = (facts.path, getattr(node, "lineno", 0))
        callers = [witness(f2, f2.scope_of(c2), at) for f2, c2 in sites]
        return PAIRED if all(v == PAIRED for v in callers) else own
    if isinstance(scope, FUNCTION_NODES) and control_flow.zero_only_function(scope) and not sites:
        deco = _zero_only_decorator(scope)
        if deco is None:
            return Unseen(f"it takes `{scope.name}()` for a rank-0-only function from its name alone")
        line = getattr(node, "lineno", scope.lineno)
        what = facts.project.call_collective_name(facts, node) if isinstance(node, ast.Call) else None
        what = what or (f"{ast.unparse(node.func)}()" if isinstance(node, ast.Call) else "the collective")
        return Witness(
            f"rank 0: {what} at {facts.path}:{line} in {scope.name}() (`@{deco}`); ranks 1..: never "
            f"call {scope.name}() -> rank 0 waits at {facts.path}:{line} forever"
        )
    at = (facts.path, getattr(node, "lineno", 0))
    verdicts = [witness(f2, f2.scope_of(c2), at) for f2, c2 in sites]
    found = [v for v in verdicts if isinstance(v, Witness)]
    if found:
        return found[0]
    if verdicts and all(v == PAIRED for v in verdicts):
        return PAIRED
    unseen = [v for v in verdicts if isinstance(v, Unseen)]
    return unseen[0] if unseen else Unseen("no caller of the function is in view")


def witness(facts, scope: ast.AST, reach: tuple | None = None) -> Witness | Unseen | str:
    """PAIRED, a Witness, or Unseen (see the module's contract). With `reach` (a file and
    line), PAIRED only when some class issues the collective there on some path: a caller
    that never gets to it pairs nothing up."""
    classes = [RankClass("rank 0", 0, 0), RankClass("local rank 0 of another node", None, 0)]
    classes.append(RankClass("ranks 1..", None, None))
    todo: list[dict] = [{}]
    tried, reached = 0, False
    while todo:
        tried += 1
        if tried > _PATHS:
            return Unseen("too many paths through it to follow")
        answers = todo.pop()
        try:
            known = frozenset(c.rank for c in classes if c.rank)
            runs = [_run(facts, scope, c, answers, known, reach) for c in classes]
        except _Need as e:
            todo += [{**answers, e.key: False}, {**answers, e.key: True}]
            continue
        except _NewRank as e:
            classes.insert(1, RankClass(f"rank {e.value}", e.value, None))
            todo.append(answers)
            continue
        except _Undecided as e:
            return Unseen(e.reason)
        found = _compare([r for r in runs if r is not None], answers)
        if found is not None:
            return found
        reached = reached or any(r is not None and r.hit for r in runs)
    if reach is not None and not reached:
        return Unseen("the callers in view do not reach it on the paths it follows")
    return PAIRED


def _run(facts, scope: ast.AST, cls: RankClass, answers: dict, known: frozenset, reach=None) -> _Run | None:
    """One class's collectives on one path, ended by its last step; None when it raises."""
    run = _Run(cls, answers, known, reach=reach)
    frame = _Frame(facts, scope)
    body = scope.body if isinstance(scope, (ast.Module, *FUNCTION_NODES)) else []
    try:
        sig = _block(run, frame, body)  # type: ignore[arg-type]
    except _Exit as e:
        if e.kind == "raise":
            return None
        run.events.append(e.step)
        return run
    if isinstance(sig, Step):
        run.events.append(sig)
    elif sig == "raise":
        return None
    else:
        name = f"end of {scope.name}()" if isinstance(scope, FUNCTION_NODES) else "end of the script"
        last = getattr(body[-1], "end_lineno", 1) if body else 1
        run.events.append(Step(name, facts.path, last or 1))
    return run


def _compare(runs: list[_Run], answers: dict) -> Witness | None:
    """The first pair of classes whose collectives differ, as a witness."""
    best = None
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            at = _parting(a.events, b.events)
            # the plainest pair first: another node's local rank 0 only when it alone parts
            other_node = any(r.cls.rank is None and r.cls.local == 0 for r in (a, b))
            if at is not None and (best is None or (at, other_node) < best[:2]):
                best = (at, other_node, a, b)
    if best is None:
        return None
    at, _, a, b = best
    return Witness(_describe(at, a, b, answers))


def _collective(s: Step) -> bool:
    return not _is_end(s) and s.what not in ("leaves the loop", "goes round the loop again")


def _is_end(s: Step) -> bool:
    return s.what in ("return", "exit") or s.what.startswith("end of ")


def _parting(x: list[Step], y: list[Step]) -> int | None:
    for i, (s, t) in enumerate(zip(x, y, strict=False)):
        if _is_end(s) and _is_end(t):
            return None
        if _is_end(s) or _is_end(t) or s.what != t.what:
            return i
    return None


def _where(s: Step) -> str:
    return f"{s.what} at {s.path}:{s.line}"


def _describe(at: int, a: _Run, b: _Run, answers: dict) -> str:
    def side(r: _Run) -> str:
        s = r.events[at]
        then = f", then {r.events[at + 1].what}" if at + 1 < len(r.events) else ""
        return f"{r.cls.label}: {_where(s)}{then}"

    sa, sb = a.events[at], b.events[at]
    if _collective(sa) != _collective(sb) or not _collective(sa):
        # one side waits in a collective the other never joins (or goes round the loop to one)
        first = _collective(sa) or sa.what == "goes round the loop again"
        waiter, step = (a, sa) if first else (b, sb)
        verb = "wait" if waiter.cls.label.startswith("ranks") else "waits"
        outcome = f"{waiter.cls.label} {verb} at {step.path}:{step.line} forever"
    else:
        outcome = f"{sa.what} meets {sb.what}: the ranks wait for each other, or exchange the wrong data"
    used = [f"`{k}` is {'true' if v else 'false'}" for k, v in answers.items()]
    when = f"when {' and '.join(used)}: " if used else ""
    return f"{when}{side(a)}; {side(b)} -> {outcome}"


# ----- statements --------------------------------------------------------------------


def _block(run: _Run, frame: _Frame, stmts: list[ast.stmt]):
    """None, or what ended the block: "break", "continue", "raise", or the return's Step."""
    for s in stmts:
        sig = _stmt(run, frame, s)
        if sig is not None:
            return sig
    return None


def _stmt(run: _Run, frame: _Frame, s: ast.stmt):
    run.work += 1
    if run.work > _WORK:
        raise _Undecided("the code it reaches is too long to follow")
    if isinstance(s, (*FUNCTION_NODES, ast.ClassDef, ast.Import, ast.ImportFrom)):
        return None
    if isinstance(s, ast.If):
        if not _matters(frame, s):
            return None
        return _block(run, frame, s.body if _truth(run, frame, s.test) else s.orelse)
    if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
        return _loop(run, frame, s)
    if isinstance(s, (ast.With, ast.AsyncWith)):
        return _with(run, frame, s, 0)
    if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
        sig = _block(run, frame, s.body)  # type: ignore[attr-defined]
        if sig is None:
            sig = _block(run, frame, s.orelse)  # type: ignore[attr-defined]
        final = _block(run, frame, s.finalbody)  # type: ignore[attr-defined]
        return final if final is not None else sig
    if isinstance(s, ast.Return):
        if s.value is not None:
            _expr(run, frame, s.value)
        return Step("return", frame.facts.path, s.lineno)  # type: ignore[attr-defined]
    if isinstance(s, ast.Raise):
        return "raise"
    if isinstance(s, (ast.Break, ast.Continue)):
        return "break" if isinstance(s, ast.Break) else "continue"
    for child in ast.iter_child_nodes(s):
        if isinstance(child, ast.expr):
            _expr(run, frame, child)
    return None


def _loop(run: _Run, frame: _Frame, s: ast.For | ast.AsyncFor | ast.While):
    """One pass through the body; a class that leaves early (`break`) while another goes
    round again parts from it at the loop."""
    if not _matters(frame, s):
        return None
    if not isinstance(s, ast.While):
        _expr(run, frame, s.iter)
    sig = _block(run, frame, s.body)
    has_collective = _has_collective(frame, s.body)
    path = frame.facts.path  # type: ignore[attr-defined]
    if sig == "break":
        if has_collective:
            run.events.append(Step("leaves the loop", path, s.lineno))
        return None
    if sig not in (None, "continue"):
        return sig
    if has_collective:
        first = next(n for b in s.body for n in ast.walk(b) if isinstance(n, ast.Call) and _issues(frame.facts, n))
        run.events.append(Step("goes round the loop again", path, first.lineno))
    return _block(run, frame, s.orelse)


def _with(run: _Run, frame: _Frame, s: ast.With | ast.AsyncWith, i: int):
    """The items in order: a project context manager's code runs around the body (the
    rest of the items, then the body) at its `yield`."""
    if i == len(s.items):
        return _block(run, frame, s.body)
    expr = s.items[i].context_expr
    target = _generator(frame, expr)
    if target is None:
        _expr(run, frame, expr)
        return _with(run, frame, s, i + 1)
    f2, d, call = target
    box: dict = {}

    def inner():
        box["sig"] = _with(run, frame, s, i + 1)

    callee = _Frame(f2, d, _bind(frame, d, call), inner, frame.depth + 1)
    sig = _block(run, callee, d.body)
    if sig == "raise":
        return sig
    return box.get("sig")


# ----- expressions and calls ----------------------------------------------------------


def _expr(run: _Run, frame: _Frame, node: ast.AST) -> None:
    """The collectives an expression issues, in order; a rank test inside it (`x if
    is_main else y`, `is_main and barrier()`) is decided like an `if`."""
    if isinstance(node, (ast.Lambda, *FUNCTION_NODES)):
        return
    if isinstance(node, ast.IfExp):
        if _matters(frame, node.body) or _matters(frame, node.orelse):
            _expr(run, frame, node.body if _truth(run, frame, node.test) else node.orelse)
        return
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _expr(run, frame, v)
            if v is not node.values[-1] and _matters(frame, node):
                t = _truth(run, frame, v)
                if t == isinstance(node.op, ast.Or):
                    return
        return
    if isinstance(node, (ast.Yield, ast.YieldFrom)) and callable(frame.on_yield):
        frame.on_yield()
        return
    for child in ast.iter_child_nodes(node):
        _expr(run, frame, child)
    if isinstance(node, ast.Call):
        _call(run, frame, node)


def _call(run: _Run, frame: _Frame, call: ast.Call) -> None:
    facts = frame.facts
    project = facts.project  # type: ignore[attr-defined]
    if run.reach == (facts.path, call.lineno):  # type: ignore[attr-defined]
        run.hit = True
    name = project.call_collective_name(facts, call)
    if name:
        run.events.append(Step(name, facts.path, call.lineno))  # type: ignore[attr-defined]
        return
    if ast.unparse(call.func) in _EXIT_CALLS:
        raise _Exit("exit", Step("exit", facts.path, call.lineno))  # type: ignore[attr-defined]
    for f2, d in project.resolve(facts, call):
        if frame.depth >= _DEPTH and d in project.collective_functions:
            raise _Undecided("its calls into collectives nest too deep to follow")
        if control_flow.zero_only_function(d) and run.cls.rank != 0:
            return  # `@rank_zero_only`: the other ranks skip the call
        if d in project.collective_functions and d is not frame.fn and not _is_generator(d):
            callee = _Frame(f2, d, _bind(frame, d, call), None, frame.depth + 1)
            key = (id(d), tuple(sorted((p, _settled(v)) for p, v in callee.env.items())))
            if key not in run.done:
                start = len(run.events)
                sig = _block(run, callee, d.body)
                run.done[key] = (run.events[start:], sig)
            else:
                steps, sig = run.done[key]
                run.events += steps
            if sig == "raise":
                raise _Exit("raise", Step("raise", f2.path, d.lineno))
            return


def _zero_only_decorator(d: ast.AST) -> str | None:
    for x in d.decorator_list:  # type: ignore[attr-defined]
        name = ast.unparse(x).split("(")[0]
        if name.split(".")[-1] in control_flow.ZERO_ONLY_DECORATORS:
            return name
    return None


def _settled(bound: tuple) -> tuple:
    """What a parameter is given, for telling two calls apart: a constant by its value
    (followed through the callers' parameters), anything else by its place."""
    caller, expr = bound
    while isinstance(expr, ast.Name) and caller is not None and expr.id in caller.env:
        caller, expr = caller.env[expr.id]
    if isinstance(expr, ast.Constant):
        return ("constant", repr(expr.value))
    return ("expression", id(expr))


def _generator(frame: _Frame, expr: ast.AST):
    """(facts, def, call) of a project context manager (a generator with a collective)."""
    if not isinstance(expr, ast.Call) or frame.depth >= _DEPTH:
        return None
    project = frame.facts.project  # type: ignore[attr-defined]
    for f2, d in project.resolve(frame.facts, expr):
        if _is_generator(d) and d in project.collective_functions:
            return f2, d, expr
    return None


def _is_generator(d: ast.AST) -> bool:
    return any(
        isinstance(n, (ast.Yield, ast.YieldFrom)) and _owner(n, d)
        for n in ast.walk(d)  # cheap enough: small defs
    )


def _owner(node: ast.AST, d: ast.AST) -> bool:
    """`node` belongs to `d` itself, not a function nested in it."""
    for n in ast.walk(d):
        if n is not d and isinstance(n, (*FUNCTION_NODES, ast.Lambda)) and any(m is node for m in ast.walk(n)):
            return False
    return True


def _bind(frame: _Frame, d: ast.AST, call: ast.Call) -> dict:
    """The callee's parameters -> (frame, expression) they are given; defaults in the
    callee's own frame (None for its frame: filled by the caller of `_bind`)."""
    params = [a.arg for a in d.args.posonlyargs + d.args.args]  # type: ignore[attr-defined]
    if params[:1] in (["self"], ["cls"]) and isinstance(call.func, ast.Attribute):
        params = params[1:]
    env: dict = {}
    defaults = d.args.defaults  # type: ignore[attr-defined]
    for p, v in zip(params[len(params) - len(defaults) :], defaults, strict=False):
        env[p] = (None, v)
    for p, v in zip(d.args.kwonlyargs, d.args.kw_defaults, strict=False):  # type: ignore[attr-defined]
        if v is not None:
            env[p.arg] = (None, v)
    if any(isinstance(a, ast.Starred) for a in call.args):
        return {}
    for p, v in zip(params, call.args, strict=False):
        env[p] = (frame, v)
    for k in call.keywords:
        if k.arg:
            env[k.arg] = (frame, k.value)
    return env


# ----- which statements matter ----------------------------------------------------------


def _matters(frame: _Frame, node: ast.AST) -> bool:
    """The node holds a collective, a call into one, an exit or a `yield`: only then does
    a test around it need an answer."""
    facts = frame.facts
    cache = facts.__dict__.setdefault("_rank_runs_matters", {})  # type: ignore[attr-defined]
    key = id(node)
    if key not in cache:
        cache[key] = any(
            isinstance(n, (ast.Return, ast.Raise, ast.Break, ast.Continue, ast.Yield, ast.YieldFrom))
            or (isinstance(n, ast.Call) and (_issues(facts, n) or ast.unparse(n.func) in _EXIT_CALLS))
            for n in ast.walk(node)
        )
    return cache[key]


def _has_collective(frame: _Frame, body: list[ast.stmt]) -> bool:
    return any(isinstance(n, ast.Call) and _issues(frame.facts, n) for s in body for n in ast.walk(s))


def _issues(facts, call: ast.Call) -> bool:
    project = facts.project
    return bool(project.call_collective_name(facts, call)) or project.reached_collective(facts, call) is not None


# ----- tests, decided per rank class ------------------------------------------------------


def _truth(run: _Run, frame: _Frame, test: ast.AST) -> bool:
    """The test's answer for this class on this path."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return not _truth(run, frame, test.operand)
    if isinstance(test, ast.BoolOp):
        want = isinstance(test.op, ast.Or)
        return want if any(_truth(run, frame, v) == want for v in test.values) else not want
    if isinstance(test, ast.Name) and test.id in frame.env:
        caller, value = frame.env[test.id]
        return _truth(run, caller or _Frame(frame.facts, frame.fn), value)
    facts = frame.facts
    if control_flow.is_env_presence(test):
        return True  # launched by torchrun: the multi-process run is the one that hangs
    sign = control_flow.distributed_test(test)
    if sign:
        return sign == 1
    made = _made_truth(run, frame, test)
    if made is not None:
        return made
    kind = control_flow.guard_kind(facts, test)
    if kind is not None:
        return _rank_truth(run, frame, test, kind)
    key = ast.unparse(test)
    if key not in run.answers:
        raise _Need(key)
    return run.answers[key]


def _made_truth(run: _Run, frame: _Frame, test: ast.AST) -> bool | None:
    """`writer is not None` (or `writer`, `writer is None`) for an object made only under
    a rank test in this file (`writer = SummaryWriter() if rank == 0 else None`): true
    exactly where that test is. None for any other test."""
    flip, node = False, test
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        node, flip = test.left, isinstance(test.ops[0], ast.Is)
    name = ref(node)
    if not name or name not in rank_values.made_objects(frame.facts):
        return None
    made = _making_test(frame.facts, name)
    return None if made is None else _truth(run, frame, made) != flip


def _making_test(facts, name: str) -> ast.AST | None:
    """The rank test an object is made under: `x = Make() if test else None`, or `x =
    Make()` in a branch of `if test:` (its negation in the else branch)."""
    for n in facts.nodes:
        if not (isinstance(n, ast.Assign) and any(ref(t) == name for t in n.targets)):
            continue
        v = n.value
        if isinstance(v, ast.IfExp):
            none_body = isinstance(v.body, ast.Constant) and v.body.value is None
            return ast.UnaryOp(op=ast.Not(), operand=v.test) if none_body else v.test
        if isinstance(v, ast.Call):
            parent = facts.parents.get(n)
            if isinstance(parent, ast.If) and n in parent.body:
                return parent.test
            if isinstance(parent, ast.If) and n in parent.orelse:
                return ast.UnaryOp(op=ast.Not(), operand=parent.test)
    return None


def _value(cls: RankClass, kind: str) -> int | None:
    return cls.local if kind == control_flow.LOCAL else cls.rank


def _rank_truth(run: _Run, frame: _Frame, test: ast.AST, kind: str) -> bool:
    """A rank test: a comparison of a rank with constants, or a rank or flag by its truth."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        return _compare_rank(run, frame, test, kind)
    if isinstance(test, (ast.Name, ast.Attribute, ast.Call)):
        low = (word(test.func) if isinstance(test, ast.Call) else word(test)) or ""
        value = _value(run.cls, control_flow.LOCAL if is_local_word(low) else kind)
        if any(w in low.lower() for w in _FLAG_WORDS):
            return value == 0
        if "rank" in low.lower() or low == "gpu_id":
            return value != 0
        definition = _flag_value(frame, test)
        if definition is not None:
            return _truth(run, frame, definition)
    raise _Undecided(f"it cannot tell which ranks pass `{ast.unparse(test)[:60]}`")


def _flag_value(frame: _Frame, test: ast.AST) -> ast.AST | None:
    """The one value a flag is given in its file (`is_first = rank == 0`)."""
    name = ast.unparse(test)
    values = [
        n.value
        for n in frame.facts.nodes  # type: ignore[attr-defined]
        if isinstance(n, ast.Assign) and any(ast.unparse(t) == name for t in n.targets)
    ]
    return values[0] if len(values) == 1 and isinstance(values[0], (ast.Compare, ast.BoolOp, ast.UnaryOp)) else None


def _constants(node: ast.AST) -> list[int] | None:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        out = [_constants(e) for e in node.elts]
        return None if any(x is None or len(x) != 1 for x in out) else [x[0] for x in out]  # type: ignore[index]
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return [node.value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constants(node.operand)
        return [-inner[0]] if inner and len(inner) == 1 else None
    return None


def _compare_rank(run: _Run, frame: _Frame, test: ast.Compare, kind: str) -> bool:
    left, op, right = test.left, test.ops[0], test.comparators[0]
    consts = _constants(right)
    if consts is None:
        consts, left = _constants(left), right
        op = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(), ast.GtE: ast.LtE()}.get(type(op), op)
    if isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod):
        left, kind = left.left, control_flow.LOCAL  # `rank % gpus_per_node`: the local rank
    if consts is None or not isinstance(left, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        raise _Undecided(f"it cannot tell which ranks pass `{ast.unparse(test)[:60]}`")
    low = (word(left.func) if isinstance(left, ast.Call) else word(left)) or ""
    if low and any(w in low.lower() for w in _FLAG_WORDS) and "rank" not in low.lower():
        raise _Undecided(f"it cannot tell which ranks pass `{ast.unparse(test)[:60]}`")
    value = _value(run.cls, control_flow.LOCAL if is_local_word(low) else kind)
    bound = frame.env.get(left.id) if isinstance(left, ast.Name) else None
    if bound is not None and _constants(bound[1]) is not None and len(_constants(bound[1]) or ()) == 1:
        value = (_constants(bound[1]) or [0])[0]  # `rank=-1` passed in: the same on every rank
    if value is None:
        return _other(consts, op, kind, test, run.known)
    c = consts[0]
    table = {
        ast.Eq: value == c,
        ast.NotEq: value != c,
        ast.Lt: value < c,
        ast.LtE: value <= c,
        ast.Gt: value > c,
        ast.GtE: value >= c,
        ast.In: value in consts,
        ast.NotIn: value not in consts,
    }
    if type(op) not in table:
        raise _Undecided(f"it cannot tell which ranks pass `{ast.unparse(test)[:60]}`")
    return table[type(op)]


def _other(consts: list[int], op: ast.cmpop, kind: str, test: ast.AST, known: frozenset) -> bool:
    """For "another rank": above 0 and none of the numbers the tests name (each of
    those gets a class of its own)."""
    named = [c for c in consts if c > 0 and c not in known]
    if named and kind != control_flow.LOCAL and isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
        raise _NewRank(named[0])
    c = consts[0]
    plain = all(x <= 0 or (x in known and kind != control_flow.LOCAL) for x in consts)
    if isinstance(op, (ast.Eq, ast.In)):
        return False if plain else _undecided(test)
    if isinstance(op, (ast.NotEq, ast.NotIn)):
        return True if plain else _undecided(test)
    if isinstance(op, ast.Gt) and c <= 0 or isinstance(op, ast.GtE) and c <= 1:
        return True
    if isinstance(op, ast.Lt) and c <= 1 or isinstance(op, ast.LtE) and c <= 0:
        return False
    return _undecided(test)


def _undecided(test: ast.AST) -> bool:
    raise _Undecided(f"it cannot tell which ranks pass `{ast.unparse(test)[:60]}`")
