"""Which paths a statement runs on: exclusive branches, rank guards and their kind.

Contract: every function takes the `Facts` of one script (duck-typed, so this module
does not import facts.py) and only reads its tree. Two statements in different
branches of one if/elif/else chain never run on the same pass (`exclusive`), so a rule
that needs two statements to meet (DataParallel inside DDP, an optimizer before the
wrap, a save after the wrap) must not combine them. A rank guard is "global" (RANK,
`dist.get_rank() == 0`, is_main...: one process in the job) or "local" (LOCAL_RANK,
`local_rank`, a variable read from LOCAL_RANK: one process *per node*).
"""

from __future__ import annotations

import ast

from disttrain.doctor.names import ref as _ref
from disttrain.doctor.names import word as _word
from disttrain.doctor.rank_names import env_rank_kind, is_guard_word, is_local_word, named_rank_counts

GLOBAL = "global"
LOCAL = "local"
SOLO = "solo"  # a single-process path: no other rank runs it at all

# A function so named or decorated runs on rank 0 only (`@rank_zero_only`, `log_rank0`).
_ZERO_ONLY_WORDS = (
    "rank0",
    "rank_0",
    "rank_zero",
    "main_process_only",
    "master_only",
    "main_only",
    "zero_only",
    "on_main_process",
)
# Decorators that run the function on the main process only (LAVIS' `@main_process`).
ZERO_ONLY_DECORATORS = (
    "main_process",
    "master_process",
    "is_main_process",
    "rank_zero_only",
    "only_main",
    "on_rank_0",
    "rank0_only",
)

# Statements that end a block: after `if rank != 0: return`, the rest is rank 0 only.
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)


def exclusive(facts, a: ast.AST, b: ast.AST) -> bool:
    """True when `a` and `b` lie in different branches of the same if/elif/else chain
    (or conditional expression): no single pass through the code runs both."""
    chain_a = [a, *facts.ancestors(a)]
    seen = {id(n): i for i, n in enumerate(chain_a)}
    child_b = b
    for anc in facts.ancestors(b):
        if id(anc) in seen:
            i = seen[id(anc)]
            if i == 0 or not isinstance(anc, (ast.If, ast.IfExp)):
                return False
            return _branch(anc, chain_a[i - 1]) * _branch(anc, child_b) == -1
        child_b = anc
    return False


def _branch(node: ast.If | ast.IfExp, child: ast.AST) -> int:
    """+1 in the body, -1 in the else branch (elif included), 0 in the test."""
    if isinstance(node, ast.IfExp):
        return 1 if child is node.body else -1 if child is node.orelse else 0
    return 1 if child in node.body else -1 if child in node.orelse else 0


def guard_kind(facts, test: ast.AST) -> str | None:
    """ "global" or "local" when an `if` test checks the rank, None otherwise. A test
    that checks both (`rank == 0 and local_rank == 0`) is global."""
    cache = facts.__dict__.setdefault("_guard_kinds", {})
    key = id(test)
    if key not in cache:
        cache[key] = _guard_kind(facts, test)
    return cache[key]


def _guard_kind(facts, test: ast.AST) -> str | None:
    if is_env_presence(test):
        return None
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and _or_on_every_rank(facts, test):
        return None
    variables = facts.rank_variables
    funcs = facts.project.rank_flag_functions
    kinds = set()
    for n in ast.walk(test):
        word, name = _word(n), _ref(n)
        if word and word.lower().endswith("_only"):
            continue  # a mode flag (`if rank0_only:`, FSDP's option): the same on every rank
        if name in variables:
            kinds.add(variables[name])
        elif isinstance(n, ast.Call) and _word(n.func) in funcs:
            kinds.add(funcs[_word(n.func)])
        elif word and not named_rank_counts(facts, n, word):
            continue  # `if self.negatives_across_rank:`: a setting, not a rank
        elif word and is_local_word(word):
            kinds.add(LOCAL)
        elif word and is_guard_word(word):
            kinds.add(GLOBAL)
        elif isinstance(n, ast.Constant) and env_rank_kind(n.value):
            kinds.add(LOCAL if env_rank_kind(n.value) == LOCAL else GLOBAL)
    return GLOBAL if GLOBAL in kinds else LOCAL if kinds else None


def _or_on_every_rank(facts, test: ast.BoolOp) -> bool:
    """`is_main and a or b`: Python binds `and` first, so when every rank test sits inside
    an `and` alternative and another alternative tests no rank (and is not "single
    process?", `not args.distributed`), that alternative makes the test true on every
    rank. `not fsdp or rank == 0` (a mode, or the rank alone) stays a guard."""
    bare = [v for v in test.values if not (isinstance(v, ast.BoolOp) and isinstance(v.op, ast.And))]
    if any(guard_kind(facts, v) for v in bare):
        return False
    return any(guard_kind(facts, v) is None and distributed_test(v) != -1 for v in test.values)


_DIST_WORDS = {
    "distributed",
    "ddp",
    "is_distributed",
    "use_ddp",
    "multiprocessing_distributed",
    "use_distributed",
    "is_ddp",
    "dist_on",
    "use_dist",
    "distributed_run",
}
# `dist.is_available()`: false means one process for sure (jukebox's print_all), so its
# else branch (and `not dist.is_available()`) is a single-process path
_DIST_CALLS = {
    "is_initialized",
    "is_dist_avail_and_initialized",
    "is_dist_initialized",
    "is_distributed",
    "is_dist",
    "dist_is_initialized",
    "is_available",
}


def distributed_test(test: ast.AST) -> int:
    """+1 when `test` is true exactly in a multi-process run (`if args.distributed:`,
    `if dist.is_initialized()`, `world_size > 1`, `local_rank != -1`), -1 when it is true
    exactly in a single-process one (`if not args.distributed`, `world_size == 1`), 0 for
    any other test. The same answer on every rank: no rank guard, but the single-process
    branch runs as one process."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -distributed_test(test.operand)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        signs = {distributed_test(v) for v in test.values}
        # true only when single-process (`cuda and RANK == -1 and n_gpu > 1`): -1
        return 1 if signs == {1} else -1 if -1 in signs and 1 not in signs else 0
    if isinstance(test, (ast.Name, ast.Attribute)):
        return 1 if (_word(test) or "").lower() in _DIST_WORDS else 0
    if isinstance(test, ast.Call):
        w = _word(test.func)
        if w == "is_available":  # torch.distributed's, not torch.cuda's
            owner = _ref(test.func.value) if isinstance(test.func, ast.Attribute) else None
            return 1 if owner and "dist" in owner.lower() else 0
        return 1 if w in _DIST_CALLS else 0
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        w = (_word(test.left) or "").lower()
        if isinstance(test.left, ast.Call) and _word(test.left.func) in ("get_world_size",):
            w = "world_size"
        c, op = test.comparators[0], test.ops[0]
        value = (
            c.value
            if isinstance(c, ast.Constant)
            else -c.operand.value
            if (
                isinstance(c, ast.UnaryOp)
                and isinstance(c.op, ast.USub)
                and isinstance(c.operand, ast.Constant)
                and isinstance(c.operand.value, int)
            )
            else None
        )
        if not isinstance(value, int):
            return 0
        if w in ("world_size", "num_gpus", "n_gpu", "ngpus", "nprocs", "num_processes", "gpus"):
            if (isinstance(op, ast.Gt) and value == 1) or (isinstance(op, ast.GtE) and value == 2):
                return 1
            if isinstance(op, (ast.Eq, ast.LtE)) and value == 1:
                return -1
        if (is_local_word(w) or "rank" in w) and value == -1:
            return (
                1
                if isinstance(op, (ast.NotEq, ast.Gt, ast.GtE))
                else -1
                if isinstance(op, (ast.Eq, ast.Lt, ast.LtE))
                else 0
            )
        if "rank" in w and value == 0 and isinstance(op, (ast.GtE, ast.Lt)):
            return 1 if isinstance(op, ast.GtE) else -1  # `rank >= 0`: set up at all?
    return 0


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def is_env_presence(test: ast.AST) -> bool:
    """`"RANK" in os.environ`, `os.environ.get("RANK") is not None`, `os.getenv("RANK")`:
    "launched by torchrun?", the same answer on every rank, so no rank guard."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if isinstance(test, ast.BoolOp):  # `"RANK" in os.environ and "WORLD_SIZE" in os.environ`
        return all(is_env_presence(v) for v in test.values)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, (ast.In, ast.NotIn)):
            return isinstance(test.left, ast.Constant) and test.left.value in _ENV_KEYS
        if isinstance(op, (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
            test = test.left
    return (
        isinstance(test, ast.Call)
        and _word(test.func) in ("get", "getenv")
        and bool(test.args)
        and isinstance(test.args[0], ast.Constant)
        and test.args[0].value in _ENV_KEYS
    )


def is_rank_test(facts, test: ast.AST) -> bool:
    return guard_kind(facts, test) is not None


def rank_guard(facts, node: ast.AST, subset: bool = False, local: bool = False) -> str | None:
    """The kind of guard `node` runs under: "global" (one rank of the job), "local" (one
    per node), "solo" (a single-process path: the else branch of `if args.distributed:`,
    the launcher's parent around `mp.spawn`), None when it runs on every rank as far as
    the source shows. Recognised: either branch of an `if` or a conditional expression
    that tests the rank (through any rank-derived value), the right side of `rank == 0
    and ...`, an early exit `if rank != 0: return` before it in the same block, inside
    a function decorated or named rank-zero-only, or whose every call site in the run is
    guarded. `subset=True` asks instead whether some rank may not reach `node`: an exit
    on rank 0 (`if rank == 0: return`) counts too (the rest runs without rank 0).
    `local=True` leaves out the guard a function gets from its call sites (not its name):
    the guard written around `node` in its own function."""
    kinds = set()
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, (ast.If, ast.IfExp)) and child is not a.test:
            sign = distributed_test(a.test)
            if sign:
                in_body = child is a.body or (isinstance(a.body, list) and child in a.body)
                if (sign == 1) != in_body:
                    kinds.add(SOLO)
            else:
                k = guard_kind(facts, a.test)
                if k:
                    kinds.add(k)
        elif isinstance(a, ast.BoolOp) and isinstance(a.op, ast.And) and child in a.values:
            for v in a.values[: a.values.index(child)]:
                k = guard_kind(facts, v)
                if k:
                    kinds.add(k)
        for block in _blocks(a):
            if child in block:
                k = _early_exit_before(facts, block, block.index(child), subset)
                if k:
                    kinds.add(k)
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            k = facts.guarded_functions.get(a)
            if k and (not local or zero_only_function(a)):
                kinds.add(k)
            if a in facts.spawner_scopes:
                kinds.add(SOLO)
            break
        if isinstance(a, ast.If) and _is_main_block(a) and a in facts.spawner_scopes:
            kinds.add(SOLO)
        child = a
    return GLOBAL if GLOBAL in kinds else SOLO if SOLO in kinds else LOCAL if kinds else None


def zero_only_function(d: ast.AST) -> bool:
    """Named or decorated rank-zero-only (`@rank_zero_only`, `def log_rank0`)."""
    words = [d.name] + [ast.unparse(x) for x in d.decorator_list]  # type: ignore[attr-defined]
    decos = [ast.unparse(x).split(".")[-1].split("(")[0] for x in d.decorator_list]  # type: ignore[attr-defined]
    return any(w in x.lower() for w in _ZERO_ONLY_WORDS for x in words) or any(x in ZERO_ONLY_DECORATORS for x in decos)


def _is_main_block(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"


def spawner_scopes(facts) -> set[ast.AST]:
    """Functions that start the workers themselves (`mp.spawn(...)`, detectron2's
    `launch(main, ...)`), and the `if __name__
    == "__main__":` block that does or calls one: what runs there runs in the launcher's
    parent, once."""
    from disttrain.doctor.names import is_launcher as is_spawn  # mp.spawn or a library's launch()

    out: set[ast.AST] = set()
    names = set()
    for c, _ in facts.calls:
        if is_spawn(facts, c):
            s = facts.scope_of(c)
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(s)
                names.add(s.name)
    spawners = facts.project.spawner_defs
    for c, _ in facts.calls:  # a function that calls a launcher of the project (launch(main, ...))
        s = facts.scope_of(c)
        if (
            isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
            and s not in spawners
            and any(d in spawners for _, d in facts.project.resolve(facts, c))
        ):
            out.add(s)
            names.add(s.name)
    for stmt in facts.tree.body:
        if isinstance(stmt, ast.If) and _is_main_block(stmt):
            for n in ast.walk(stmt):
                if isinstance(n, ast.Call) and (
                    is_spawn(facts, n)
                    or _word(n.func) in names
                    or any(d in spawners for _, d in facts.project.resolve(facts, n))
                ):
                    out.add(stmt)
                    break
    return out


def guarded_functions(facts) -> dict[ast.AST, str]:
    """Functions that run on one rank (per job or per node) only, across the run's files
    (dataflow.Project.guarded)."""
    return facts.project.guarded


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [getattr(node, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(node, f, None), list)]


def _early_exit_before(facts, block: list[ast.stmt], index: int, subset: bool = False) -> str | None:
    for stmt in block[:index]:
        if isinstance(stmt, ast.If) and stmt.body and (subset or _is_negative(stmt.test)):
            if subset and not _pure_rank_test(facts, stmt.test):
                continue  # `if not fsdp_eval and not is_rank0: return`: a mode decides, not sure
            if distributed_test(stmt.test):
                continue
            kind = guard_kind(facts, stmt.test)
            last = stmt.body[-1]
            if subset and isinstance(last, ast.Raise):
                continue  # an error path (`raise RuntimeError("already initialised")`)
            if kind and ends_in_exit(stmt.body):
                return kind
    return None


def ends_in_exit(body: list[ast.stmt]) -> bool:
    """The block's last statement leaves it: `return`, `continue`, `break`, `raise` or a
    call of `sys.exit()` (`exit`, `quit`, `os._exit`)."""
    last = body[-1] if body else None
    return isinstance(last, _EXITS) or (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and ast.unparse(last.value.func) in ("sys.exit", "exit", "quit", "os._exit")
    )


def _pure_rank_test(facts, test: ast.AST) -> bool:
    """Every conjunct of the test checks the rank (`rank != 0`, `not is_main and
    local_rank != 0`), so the exit certainly applies on those ranks."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if isinstance(test, ast.BoolOp):
        return all(_pure_rank_test(facts, v) for v in test.values)
    return guard_kind(facts, test) is not None


def _is_negative(test: ast.AST) -> bool:
    """`rank != 0`, `rank > 0`, `not is_main`: the branch is for the *other* ranks, so an
    exit inside it leaves the rest of the block to rank 0 (`rank == 0: return` does not)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return True
    if isinstance(test, ast.Compare):
        return any(isinstance(op, (ast.NotEq, ast.Gt, ast.GtE, ast.IsNot)) for op in test.ops)
    if isinstance(test, ast.BoolOp):
        return any(_is_negative(v) for v in test.values)
    return False
