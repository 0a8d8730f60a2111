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

GLOBAL = "global"
LOCAL = "local"

# Words that make an `if` test a rank guard: `if rank == 0`, `if dist.get_rank() == 0`,
# `if is_main_process():`, `if accelerator.is_main_process`, `if trainer.is_global_zero`.
_GUARD_WORDS = ("rank", "is_main", "main_process", "is_master", "master_process",
                "is_primary", "primary_process", "is_global_zero", "is_chief", "rank0",
                "rank_zero", "main_only", "master_only")

# A function so named or decorated runs on rank 0 only (`@rank_zero_only`, `log_rank0`).
_ZERO_ONLY_WORDS = ("rank0", "rank_0", "rank_zero", "main_process_only", "master_only",
                    "main_only", "zero_only", "on_main_process")

# Statements that end a block: after `if rank != 0: return`, the rest is rank 0 only.
_EXITS = (ast.Return, ast.Continue, ast.Break, ast.Raise)

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


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


def _branch(node: ast.AST, child: ast.AST) -> int:
    """+1 in the body, -1 in the else branch (elif included), 0 in the test."""
    body, orelse = (node.body, node.orelse)
    if isinstance(node, ast.IfExp):
        return 1 if child is body else -1 if child is orelse else 0
    return 1 if child in body else -1 if child in orelse else 0


def _word(n: ast.AST) -> str | None:
    return n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None


def _ref(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _ref(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _is_local_word(word: str) -> bool:
    low = word.lower()
    return ("local" in low and "rank" in low) or low == "gpu_id"  # a GPU index: one per node


def is_guard_word(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in _GUARD_WORDS)


def rank_variables(facts) -> dict[str, str]:
    """Names the script reads a rank into, with the kind: `self.gpu_id =
    int(os.environ["LOCAL_RANK"])` -> {"self.gpu_id": "local"}; `r = dist.get_rank()` ->
    {"r": "global"}. Only plain reads count (not `torch.device(f"cuda:{local_rank}")`)."""
    out: dict[str, str] = {}
    for n in facts.nodes:
        if isinstance(n, ast.Assign):
            kind = _rank_source(n.value)
            if kind:
                out.update({name: kind for t in n.targets if (name := _ref(t))})
    return out


def _rank_source(value: ast.AST) -> str | None:
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and \
            value.func.id == "int" and value.args:
        value = value.args[0]
    key = None
    if isinstance(value, ast.Subscript):
        key = value.slice
    elif isinstance(value, ast.Call) and _word(value.func) in ("get", "getenv") and value.args:
        key = value.args[0]
    if isinstance(key, ast.Constant) and key.value in ("LOCAL_RANK", "RANK"):
        return LOCAL if key.value == "LOCAL_RANK" else GLOBAL
    word = _word(value.func) if isinstance(value, ast.Call) else _word(value)
    if word in ("get_local_rank", "get_node_local_rank") or (word or "").lower() == "local_rank":
        return LOCAL
    return GLOBAL if word == "get_rank" else None


def guard_kind(facts, test: ast.AST) -> str | None:
    """"global" or "local" when an `if` test checks the rank, None otherwise. A test
    that checks both (`rank == 0 and local_rank == 0`) is global."""
    if _is_env_presence(test):
        return None
    variables = facts.rank_variables
    kinds = set()
    for n in ast.walk(test):
        word, name = _word(n), _ref(n)
        if word and word.lower().endswith("_only"):
            continue  # a mode flag (`if rank0_only:`, FSDP's option): the same on every rank
        if name in variables:
            kinds.add(variables[name])
        elif word and _is_local_word(word):
            kinds.add(LOCAL)
        elif word and is_guard_word(word):
            kinds.add(GLOBAL)
        elif isinstance(n, ast.Constant) and n.value in ("RANK", "LOCAL_RANK"):
            kinds.add(LOCAL if n.value == "LOCAL_RANK" else GLOBAL)
    return GLOBAL if GLOBAL in kinds else LOCAL if kinds else None


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _is_env_presence(test: ast.AST) -> bool:
    """`"RANK" in os.environ`, `os.environ.get("RANK") is not None`, `os.getenv("RANK")`:
    "launched by torchrun?", the same answer on every rank, so no rank guard."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        if isinstance(op, (ast.In, ast.NotIn)):
            return isinstance(test.left, ast.Constant) and test.left.value in _ENV_KEYS
        if isinstance(op, (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
            test = test.left
    return isinstance(test, ast.Call) and _word(test.func) in ("get", "getenv") and bool(test.args) \
        and isinstance(test.args[0], ast.Constant) and test.args[0].value in _ENV_KEYS


def is_rank_test(facts, test: ast.AST) -> bool:
    return guard_kind(facts, test) is not None


def rank_guard(facts, node: ast.AST) -> str | None:
    """The kind of rank guard `node` runs under ("global", "local"), None when it runs on
    every rank as far as the source shows. Recognised: either branch of an `if` that tests
    the rank; after an early exit `if rank != 0: return` in the same block; inside a
    function decorated or named rank-zero-only, or whose every call site is guarded."""
    kinds = set()
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, ast.If) and child is not a.test:
            k = guard_kind(facts, a.test)
            if k:
                kinds.add(k)
        for block in _blocks(a):
            if child in block:
                k = _early_exit_before(facts, block, block.index(child))
                if k:
                    kinds.add(k)
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            k = facts.guarded_functions.get(a)
            if k:
                kinds.add(k)
            break
        child = a
    return GLOBAL if GLOBAL in kinds else LOCAL if kinds else None


def guarded_functions(facts) -> dict[ast.AST, str]:
    """Functions that run on one rank (per job or per node) only: rank-zero by name or
    decorator, or called only from guarded places (a fixpoint over the script's calls)."""
    guarded: dict[ast.AST, str] = {}
    for name, defs in facts.functions.items():
        for d in defs:
            words = [name] + [ast.unparse(x) for x in d.decorator_list]
            if any(w in x.lower() for w in _ZERO_ONLY_WORDS for x in words):
                guarded[d] = GLOBAL
    sites: dict[str, list[ast.Call]] = {}
    for n in facts.nodes:
        if isinstance(n, ast.Call):
            callee = n.func.id if isinstance(n.func, ast.Name) else None
            # `self.save(...)` may be ours; `torch.save(...)` (an imported module) is not.
            if isinstance(n.func, ast.Attribute):
                head = n.func.value
                while isinstance(head, ast.Attribute):
                    head = head.value
                if not (isinstance(head, ast.Name) and head.id in facts.aliases):
                    callee = n.func.attr
            if callee in facts.functions:
                sites.setdefault(callee, []).append(n)
    facts.__dict__["guarded_functions"] = guarded  # visible to rank_guard below
    changed = True
    while changed:
        changed = False
        for name, calls in sites.items():
            kinds = [rank_guard(facts, c) for c in calls]
            if all(kinds):
                kind = GLOBAL if all(k == GLOBAL for k in kinds) else LOCAL
                for d in facts.functions[name]:
                    if guarded.get(d) != kind and guarded.get(d) != GLOBAL:
                        guarded[d] = kind
                        changed = True
    return guarded


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [getattr(node, f) for f in ("body", "orelse", "finalbody")
            if isinstance(getattr(node, f, None), list)]


def _early_exit_before(facts, block: list[ast.stmt], index: int) -> str | None:
    for stmt in block[:index]:
        if isinstance(stmt, ast.If) and _is_negative(stmt.test) and stmt.body:
            kind = guard_kind(facts, stmt.test)
            last = stmt.body[-1]
            if kind and (isinstance(last, _EXITS) or (
                isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                    and ast.unparse(last.value.func) in ("sys.exit", "exit", "quit", "os._exit"))):
                return kind
    return None


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
