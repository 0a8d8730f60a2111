"""Which values are rank-derived: the file's own rank reads and the flags computed from
them (to a fixpoint), attributes shared by the files of the run, and objects created only
under a rank guard. Asked through `Facts.rank_variables` / `Facts.own_rank_values`.
"""

from __future__ import annotations

import ast

from disttrain.doctor.control_flow import GLOBAL, LOCAL, is_env_presence
from disttrain.doctor.names import FUNCTION_NODES, kwarg_value
from disttrain.doctor.names import ref as _ref
from disttrain.doctor.names import word as _word
from disttrain.doctor.rank_names import env_rank_kind, is_guard_word, is_local_word, named_rank_counts


def rank_variables(facts) -> dict[str, str]:
    """Names and attributes that hold a rank or a rank flag, with the kind: this file's
    own (`own_rank_values`), attributes set in any file of the run (`args.save_logs = ...
    and is_master(args)` in main.py, tested in train.py), and objects created only under
    a rank guard (`writer = SummaryWriter() if rank == 0 else None`), whose tests are
    rank guards too."""
    out = dict(facts.project.shared_rank_values)
    out.update(facts.own_rank_values)
    for name, kind in _guard_made_objects(facts, out).items():
        out.setdefault(name, kind)
    for name, kind in _rank_only_params(facts).items():
        out.setdefault(name, kind)
    return out


def made_objects(facts) -> dict[str, str]:
    """`_guard_made_objects` of a file from its own and the shared rank values, once per
    file (asked for by the files it calls into)."""
    cache = facts.__dict__
    if "_made_objects" not in cache:
        values = dict(facts.project.shared_rank_values)
        values.update(facts.own_rank_values)
        cache["_made_objects"] = _guard_made_objects(facts, values)
    return cache["_made_objects"]


def _rank_only_params(facts) -> dict[str, str]:
    """Parameters of this file's functions that every call site in the run fills with an
    object created only under a rank guard (`train_one_epoch(..., log_writer=log_writer)`
    in main.py, where `log_writer = SummaryWriter()` on rank 0 and None elsewhere): the
    callee's `if log_writer is not None:` is a rank guard too."""
    out: dict[str, str] = {}
    sites = facts.project.call_sites
    for d in facts.nodes:
        if not isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) or not sites.get(d):
            continue
        params = [a.arg for a in d.args.args]
        for i, name in enumerate(params):
            kinds = [_argument_kind(f, c, name, i, params) for f, c in sites[d]]
            if kinds and None not in kinds:
                out.setdefault(name, GLOBAL if GLOBAL in kinds else LOCAL)
    return out


def _argument_kind(f, call: ast.Call, name: str, index: int, params: list[str]) -> str | None:
    """The rank kind of the guard-made object `call` passes for parameter `name`, or None."""
    value = next((k.value for k in call.keywords if k.arg == name), None)
    if value is None:
        offset = 1 if params[:1] in (["self"], ["cls"]) and isinstance(call.func, ast.Attribute) else 0
        j = index - offset
        value = call.args[j] if 0 <= j < len(call.args) else None
    ref = _ref(value) if value is not None else None
    return made_objects(f).get(ref) if ref else None


def own_rank_values(facts) -> dict[str, str]:
    """This file's rank reads (`self.gpu_id = int(os.environ["LOCAL_RANK"])` -> local,
    `r = dist.get_rank()` -> global), ranks unpacked from what a project function returns
    (`unpacked_rank_values`), and flags computed from them (`is_main = rank == 0`,
    `args.save_logs = args.logs and is_master(args)`), to a fixpoint. The value decides,
    not the name: `cfg.LOCAL_RANK` assigned `dist.get_rank()` holds the global rank."""
    out: dict[str, str] = {}
    funcs = facts.project.rank_flag_functions
    # what the script joins the group with is the rank of the group, whatever it was read
    # from (cleanrl: `init_process_group(rank=local_rank)`, so local rank 0 is rank 0)
    joined = {_ref(r) for c in facts.calls_to("init_process_group") if (r := _joined_rank(c)) is not None} - {None}
    spawned = facts.project.spawn_index_params
    if spawned:
        from disttrain.doctor.names import takes_node_rank as _takes_node_rank

        # mp.spawn passes the process index first: the rank itself on one node, a local
        # rank when the script computes the global one from a node rank (unless the
        # script joins the group with the index itself: then it is the global rank)
        index_kind = LOCAL if _takes_node_rank(facts) else GLOBAL
        for n in facts.nodes:
            if isinstance(n, ast.arg) and id(n) in spawned:
                out[n.arg] = GLOBAL if n.arg in joined else index_kind
    assigns = [n for n in facts.nodes if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
    for n in assigns:
        for held, held_kind in unpacked_rank_values(facts, n):
            out.setdefault(held, GLOBAL if held in joined else held_kind)
    for _ in range(4):
        before = len(out)
        for n in assigns:
            if n.value is None:
                continue  # (filtered above; says so to the type checker)
            kind = _rank_source(n.value) or value_rank_kind(facts, n.value, out, funcs)
            if kind:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    name = _ref(t)
                    if name and name not in out:
                        out[name] = GLOBAL if name in joined else kind
        if len(out) == before:
            break
    return out


def _joined_rank(call: ast.Call) -> ast.AST | None:
    """The `rank` an init_process_group call passes: by keyword, or fifth by position
    (backend, init_method, timeout, world_size, rank)."""
    plain = [a for a in call.args if not isinstance(a, ast.Starred)]
    return kwarg_value(call, "rank") or (call.args[4] if len(plain) == len(call.args) > 4 else None)


_NOT_FLAGS = ("world_size", "world", "device", "seed", "size", "num", "count", "len", "n_gpu", "ngpus")


def value_rank_kind(facts, value: ast.AST, variables: dict, funcs: dict) -> str | None:
    """The kind of rank an expression holds or tests, None for anything else. Plain copies
    (`rank = args.rank`), `rank % ngpus` (a local rank), comparisons and boolean
    combinations with a rank (`rank == 0`, `not distributed or rank == 0`), calls of a
    function that returns one (`is_master(args)`, `utils.is_main_process()`)."""
    if isinstance(value, (ast.Name, ast.Attribute)):
        r = _ref(value)
        return variables.get(r) if r else None
    if isinstance(value, ast.Call):
        w = _word(value.func)
        if w in funcs:
            return funcs[w]
        if w and is_guard_word(w) and not any(x in w.lower() for x in _NOT_FLAGS):
            return GLOBAL
        if w in ("int", "bool") and value.args:
            return value_rank_kind(facts, value.args[0], variables, funcs)
        return None
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mod):
        return LOCAL if value_rank_kind(facts, value.left, variables, funcs) else None
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not):
        return value_rank_kind(facts, value.operand, variables, funcs)
    if isinstance(value, ast.IfExp):
        return (
            value_rank_kind(facts, value.test, variables, funcs)
            if all(isinstance(x, ast.Constant) and isinstance(x.value, bool) for x in (value.body, value.orelse))
            else None
        )
    if isinstance(value, (ast.Compare, ast.BoolOp)):
        parts = [value.left, *value.comparators] if isinstance(value, ast.Compare) else value.values
        kinds = set()
        for part in parts:
            k = value_rank_kind(facts, part, variables, funcs)
            if k is None and isinstance(part, (ast.Name, ast.Attribute)):
                w = _word(part) or ""
                if is_local_word(w):
                    k = LOCAL
                elif is_guard_word(w) and not any(x in w.lower() for x in _NOT_FLAGS):
                    k = GLOBAL
            if k:
                kinds.add(k)
        return GLOBAL if GLOBAL in kinds else LOCAL if kinds else None
    return None


def _guard_made_objects(facts, variables: dict) -> dict[str, str]:
    """Objects that exist on the guarded ranks only: `writer = SummaryWriter(...) if rank
    == 0 else None`, or assigned a call under an `if` on the rank and elsewhere only None."""
    made: dict[str, str] = {}
    plain: set[str] = set()
    for n in facts.nodes:
        if not isinstance(n, ast.Assign) or len(n.targets) != 1:
            continue
        name = _ref(n.targets[0])
        if not name:
            continue
        v = n.value
        if isinstance(v, ast.Constant) and v.value is None:
            continue
        if isinstance(v, ast.IfExp) and (_is_none(v.orelse) or _is_none(v.body)):
            k = _test_kind(facts, v.test, variables)
            if k:
                made[name] = k
                continue
        if isinstance(v, ast.Call):
            k = _if_guard_only(facts, n, variables)
            if k:
                made[name] = k
                continue
        plain.add(name)
    return {k: v for k, v in made.items() if k not in plain}


def _is_none(n: ast.AST) -> bool:
    return isinstance(n, ast.Constant) and n.value is None


def _test_kind(facts, test: ast.AST, variables: dict) -> str | None:
    if is_env_presence(test):
        return None
    kinds = set()
    for n in ast.walk(test):
        w, name = _word(n), _ref(n)
        if w and w.lower().endswith("_only"):
            continue
        if name in variables:
            kinds.add(variables[name])
        elif w and not named_rank_counts(facts, n, w):
            continue  # a setting named after ranks, tested for its truth
        elif w and is_local_word(w):
            kinds.add(LOCAL)
        elif w and is_guard_word(w):
            kinds.add(GLOBAL)
    return GLOBAL if GLOBAL in kinds else LOCAL if kinds else None


def _if_guard_only(facts, node: ast.AST, variables: dict) -> str | None:
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, ast.If) and child is not a.test:
            k = _test_kind(facts, a.test, variables)
            if k:
                return k
        if isinstance(a, FUNCTION_NODES):
            return None
        child = a
    return None


def _rank_source(value: ast.AST) -> str | None:
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "int" and value.args:
        value = value.args[0]
    key = None
    if isinstance(value, ast.Subscript):
        key = value.slice
    elif isinstance(value, ast.Call) and _word(value.func) in ("get", "getenv") and value.args:
        key = value.args[0]
    if isinstance(key, ast.Constant) and env_rank_kind(key.value):
        return LOCAL if env_rank_kind(key.value) == LOCAL else GLOBAL
    word = _word(value.func) if isinstance(value, ast.Call) else _word(value)
    if word in ("get_local_rank", "get_node_local_rank") or (word or "").lower() == "local_rank":
        return LOCAL  # torch's, Horovod's `hvd.local_rank()`, an `args.local_rank` copied
    # torch's `get_rank()`, Horovod's `hvd.rank()`, mpi4py's `comm.Get_rank()`
    called = isinstance(value, ast.Call) and word in ("rank", "Get_rank")
    return GLOBAL if word == "get_rank" or called else None


def unpacked_rank_values(facts, node: ast.AST) -> list[tuple[str, str]]:
    """`n, cfg.rank = init_dist(...)` where every project function the call may reach
    returns a tuple whose element there is a rank read in that function (`rank =
    dist.get_rank(); return n, rank`): (`cfg.rank`, its kind). A call through
    `getattr(module, "init_dist_%s" % launcher)` may reach any module-level function of
    the run named with that prefix."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return []
    defs = facts.project.resolve(facts, node.value) or _dispatched(facts, node.value)
    out = []
    for t in node.targets:
        if not isinstance(t, ast.Tuple) or not defs:
            continue
        for i, e in enumerate(t.elts):
            kinds = {_returned_kind(f, d, i, len(t.elts)) for f, d in defs}
            name = _ref(e)
            if name and None not in kinds:
                out.append((name, LOCAL if LOCAL in kinds else GLOBAL))
    return out


def _dispatched(facts, call: ast.Call) -> list:
    """The functions `getattr(module, "prefix_%s" % x)(...)` may call."""
    f = call.func
    if not (isinstance(f, ast.Call) and _word(f.func) == "getattr" and len(f.args) == 2):
        return []
    name = f.args[1]
    if isinstance(name, ast.BinOp) and isinstance(name.op, ast.Mod):
        name = name.left
    elif isinstance(name, ast.JoinedStr) and name.values:
        name = name.values[0]
    text = name.value if isinstance(name, ast.Constant) else None
    prefix = text.split("%")[0].split("{")[0] if isinstance(text, str) else ""
    if not prefix:
        return []
    return [
        (g, d)
        for n, ds in facts.project.defs.items()
        if n.startswith(prefix)
        for g, d in ds
        if g.parents.get(d) is g.tree
    ]


def _returned_kind(f, d: ast.AST, index: int, size: int) -> str | None:
    """The rank kind of element `index` of every tuple `d` returns, None unless all agree
    that it is a rank (a name the function assigns only rank reads or constants)."""
    returns = [r for r in f.scoped.get(d, ()) if isinstance(r, ast.Return)]
    kinds = set()
    for r in returns:
        if not (isinstance(r.value, ast.Tuple) and len(r.value.elts) == size):
            return None
        kinds.add(_local_rank_kind(f, d, r.value.elts[index]))
    return None if not kinds or None in kinds else LOCAL if LOCAL in kinds else GLOBAL


def _local_rank_kind(f, d: ast.AST, value: ast.AST) -> str | None:
    if not isinstance(value, ast.Name):
        return _rank_source(value)
    kinds = set()
    for n in ast.walk(d):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets):
            if isinstance(n.value, ast.Constant) and isinstance(n.value.value, int):
                continue  # `rank = 0` on the single-process path
            kinds.add(_rank_source(n.value))
    return None if not kinds or None in kinds else LOCAL if LOCAL in kinds else GLOBAL
