"""Rules about launching and setting up ranks: process group, port, device, sampler.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast
import re

from disttrain.doctor.facts import Facts, arg, has_star_kwargs, kwarg, mentions, ref
from disttrain.doctor.findings import ADVICE, ERROR, WARNING, finding, rule
from disttrain.doctor.names import SET_DEVICE, takes_node_rank
from disttrain.doctor.rules_data import rank_kwarg_calls, reads_local_rank

# Backends that simulate a process group in one process: nothing to wait for.
_NO_COLLECTIVE_BACKENDS = ("fake", "local_tensor")


@rule(
    "init-without-timeout",
    ("P-INIT-1",),
    WARNING,
    "init_process_group without an explicit timeout",
    """torch's default collective timeout is 10 minutes (30 for some backends), so a
      rank that died or hangs stalls every other rank for that long before anything is
      reported. Pass `timeout=datetime.timedelta(minutes=...)`, shorter than the default
      (5-10 minutes for elastic jobs). The `fake` and `local_tensor` backends (tracing,
      tests) run no real collectives and need none.""",
)
def init_without_timeout(facts: Facts):
    # deepspeed.init_distributed(dist_backend, auto_mpi_discovery, distributed_port,
    # verbose, timeout, ...) starts the same process group
    for call in facts.calls_to("init_process_group", "deepspeed.init_distributed"):
        backend = arg(call, 0, "backend")
        if isinstance(backend, ast.Constant) and backend.value in _NO_COLLECTIVE_BACKENDS:
            continue  # no real collectives run, so nothing can hang
        if facts.project.resolve(facts, call):
            continue  # the project's own wrapper (jukebox's dist_adapter): its torch call is judged
        name = ast.unparse(call.func).rsplit(".", 1)[-1]
        positional = 3 if name == "init_process_group" else 5
        timeout = kwarg(call, "timeout")
        if timeout is None and not has_star_kwargs(call) and len(call.args) < positional:
            yield finding(
                facts,
                call,
                "init-without-timeout",
                f"{name}() has no timeout: a dead or hung rank stalls the others for torch's default 10-30 minutes.",
                "pass timeout=datetime.timedelta(minutes=10) (5-10 min for elastic jobs).",
            )
        elif timeout is None and len(call.args) < positional and (helper := _kwargs_without_timeout(facts, call)):
            yield finding(
                facts,
                call,
                "init-without-timeout",
                f"{name}() gets its timeout through {helper}()'s **kwargs, and no call of "
                f"{helper}() passes one: a dead or hung rank stalls the others for torch's "
                "default 10-30 minutes.",
                "pass timeout=datetime.timedelta(minutes=10) (5-10 min for elastic jobs).",
            )
        elif timeout is not None and (seconds := _seconds(timeout) or 0) > _DAY:
            yield finding(
                facts,
                call,
                "init-without-timeout",
                f"{name}()'s timeout `{ast.unparse(timeout)}` is {seconds / _DAY:.0f} "
                "days: in effect none, a dead or hung rank stalls the others that long "
                "(timedelta's first argument is days).",
                "pass timeout=datetime.timedelta(minutes=10) (5-10 min for elastic jobs).",
            )


def _kwargs_without_timeout(facts: Facts, call: ast.Call) -> str | None:
    """`def init_dist(backend="nccl", **kwargs): init_process_group(backend, **kwargs)`,
    and every call of init_dist in the run passes neither timeout= nor **something: its
    name. None when the **kwargs is not the function's own or a caller is out of view."""
    fn = facts.scope_of(call)
    stars = [k.value for k in call.keywords if k.arg is None]
    if (
        not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        or fn.args.kwarg is None
        or len(stars) != 1
        or not (isinstance(stars[0], ast.Name) and stars[0].id == fn.args.kwarg.arg)
    ):
        return None
    return fn.name if _no_caller_passes_timeout(facts, fn, 3) else None


def _no_caller_passes_timeout(facts: Facts, fn: ast.AST, depth: int) -> bool:
    """Every call of `fn` in the run passes no timeout=; one that forwards its own
    **kwargs (KAIR's init_dist -> _init_dist_pytorch) is followed to its callers."""
    sites = facts.project.call_sites.get(fn, [])
    if not sites or depth == 0:
        return False
    for f, c in sites:
        if any(k.arg == "timeout" for k in c.keywords):
            return False
        stars = [k.value for k in c.keywords if k.arg is None]
        if stars:
            outer = f.scope_of(c)
            own = (
                isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef))
                and outer.args.kwarg is not None
                and len(stars) == 1
                and isinstance(stars[0], ast.Name)
                and stars[0].id == outer.args.kwarg.arg
            )
            if not (own and _no_caller_passes_timeout(f, outer, depth - 1)):
                return False
    return True


_DAY = 86400
_UNITS = {"days": _DAY, "seconds": 1, "minutes": 60, "hours": 3600, "weeks": 7 * _DAY}


def _seconds(node: ast.AST) -> float | None:
    """The length of a constant `timedelta(...)` in seconds (positional arguments are
    days, seconds as in datetime.timedelta), None when it is not one."""
    if not (isinstance(node, ast.Call) and ast.unparse(node.func).rsplit(".", 1)[-1] == "timedelta"):
        return None
    total = 0.0
    for unit, a in zip(("days", "seconds"), node.args, strict=False):
        if not (isinstance(a, ast.Constant) and isinstance(a.value, (int, float))):
            return None
        total += _UNITS[unit] * a.value
    for k in node.keywords:
        if k.arg not in _UNITS or not (isinstance(k.value, ast.Constant) and isinstance(k.value.value, (int, float))):
            return None
        total += _UNITS[k.arg] * k.value.value
    return total


@rule(
    "init-rank-is-local-rank",
    ("P-INIT-3",),
    WARNING,
    "init_process_group given the local rank as its rank",
    """`init_process_group(rank=local_rank, world_size=WORLD_SIZE)` is right on one node
      only, where the local rank is the rank. Launched on several nodes, every node's
      processes claim ranks 0..n-1 again: two processes share each rank, and the
      rendezvous fails or waits forever. Pass the global rank (`int(os.environ["RANK"])`),
      or leave rank out and let `env://` read it.""",
)
def init_rank_is_local_rank(facts: Facts):
    for call, value in rank_kwarg_calls(facts, "init_process_group", reads_local_rank):
        yield finding(
            facts,
            call,
            "init-rank-is-local-rank",
            f"rank={ast.unparse(value)} is the node-local rank: on several nodes two "
            "processes claim each rank and the group never forms.",
            "pass the global rank (int(os.environ['RANK'])), or leave rank out under env://.",
        )


_TCP_PORT = re.compile(r"^tcp://[^/]*:\d+")


@rule(
    "hardcoded-master-port",
    ("P-INIT-4",),
    WARNING,
    "MASTER_PORT hard-coded in the script",
    """A fixed rendezvous port collides as soon as two jobs share a host ("Address
      already in use"). Let the launcher pick it: `torchrun --standalone` or `disttrain
      run` choose a free port and export MASTER_ADDR/MASTER_PORT; read them from the
      environment with `init_method="env://"` (the default).""",
)
def hardcoded_master_port(facts: Facts):
    msg = "MASTER_PORT is fixed in the script: two jobs on one host collide (Address already in use)."
    fix = "remove it and launch with `torchrun --standalone` or `disttrain run`, which pick a free port."
    for node in facts.nodes:
        # os.environ["MASTER_PORT"] = "29500"
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if environ_key(facts, t) == "MASTER_PORT":
                    yield finding(facts, node, "hardcoded-master-port", msg, fix)
        # os.environ.setdefault("MASTER_PORT", "12355") / os.putenv("MASTER_PORT", ...)
        if (
            isinstance(node, ast.Call)
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Constant)
            and _is_const_str(node.args[0], "MASTER_PORT")
        ):
            q = facts.qualname(node.func) or ""
            if q.endswith("environ.setdefault") or q.endswith("environ.update") or q == "os.putenv":
                yield finding(facts, node, "hardcoded-master-port", msg, fix)
    for call in facts.method_calls("add_argument"):
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        default = kwarg(call, "default")
        if (
            any("dist-url" in x or "dist_url" in x or "init-method" in x or "init_method" in x for x in names)
            and isinstance(default, ast.Constant)
            and isinstance(default.value, str)
            and _TCP_PORT.match(default.value)
        ):
            yield finding(
                facts,
                default,
                "hardcoded-master-port",
                f"the {names[0]} default {default.value!r} fixes the rendezvous port: two "
                "jobs on one host collide unless every launch overrides it.",
                "default to env:// (the launcher's MASTER_ADDR/MASTER_PORT), or pick a free port at launch.",
            )
    for call in facts.calls_to("init_process_group"):
        method = kwarg(call, "init_method")
        if isinstance(method, ast.Constant) and isinstance(method.value, str) and _TCP_PORT.match(method.value):
            yield finding(
                facts,
                method,
                "hardcoded-master-port",
                f"init_method={method.value!r} fixes the rendezvous port: two jobs on one host collide.",
                fix,
            )


def environ_key(facts: Facts, target: ast.AST) -> str | None:
    if isinstance(target, ast.Subscript) and (facts.qualname(target.value) or "").endswith("os.environ"):
        key = target.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    return None


def _is_const_str(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


@rule(
    "mp-spawn",
    ("P-INIT-4",),
    ADVICE,
    "mp.spawn used where torchrun fits",
    """`torch.multiprocessing.spawn` hand-rolls what torchrun does better: torchrun sets
      RANK/LOCAL_RANK/WORLD_SIZE, picks the rendezvous, restarts failed workers (elastic)
      and spans nodes. Read the rank from the environment and launch with
      `torchrun --standalone --nproc-per-node=N script.py` (or `disttrain run`).""",
)
def mp_spawn(facts: Facts):
    # the node's rank may be derived in another file of the program (mmf's infer_init_method)
    calls = facts.calls_to("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes")
    multi_node = bool(calls) and any(_takes_node_rank(f) for f in facts.project.component(facts))
    for call in calls:
        yield finding(
            facts,
            call,
            "mp-spawn",
            "mp.spawn() launches the ranks by hand: no elastic restart, "
            + ("and each node must be started by hand with its node rank" if multi_node else "no multi-node")
            + ", and the rendezvous port is yours to manage.",
            "read RANK/LOCAL_RANK/WORLD_SIZE from the environment and launch with "
            "`torchrun --standalone --nproc-per-node=N` or `disttrain run`.",
        )


_takes_node_rank = takes_node_rank


_SET_DEVICE = SET_DEVICE


@rule(
    "sampler-without-set-epoch",
    ("P-DATA-2",),
    ERROR,
    "DistributedSampler without set_epoch in the epoch loop",
    """A shuffling DistributedSampler draws its order from (seed, epoch). Unless the
      loop calls `sampler.set_epoch(epoch)` at the start of every epoch, the epoch stays 0
      and every epoch replays exactly the same order. Samplers with shuffle=False or for
      evaluation (named val/valid/eval/test, or feeding such a loader) need none. A
      sampler (or its loader) passed to a function is followed into it when the function
      is defined in this file or in the other files checked in the same run; passed to a
      function the doctor cannot see, it is a warning that says so. A sampler returned by
      the helper that builds it (alone, or in the loader it returns) is followed to the
      helper's callers: `loader.sampler.set_epoch(epoch)` there counts; with no caller in
      view, it is a warning that says so.""",
    unwitnessed="""The doctor sees no loop that reads this sampler's loader pass after pass (the
      epoch loop may reach it through an object), so it shows no run that repeats the order.""",
)
def sampler_without_set_epoch(facts: Facts):
    if facts.method_calls("set_epoch"):
        return
    if not any(isinstance(n, (ast.For, ast.AsyncFor, ast.While)) for n in facts.nodes):
        return
    # torch's sampler only; disttrain.DistributedSampler advances its epoch by itself.
    for call in facts.calls_to("DistributedSampler"):
        shuffle = arg(call, 3, "shuffle")
        if isinstance(shuffle, ast.Constant) and shuffle.value is False:
            continue  # a fixed order does not depend on the epoch
        names = sampler_names(facts, call)
        dataset = ref(arg(call, 0, "dataset") or call)
        if any(is_eval_name(n) for n in names | {dataset or ""}):
            continue  # evaluation order does not matter
        unseen, followed = [], False
        for callee in _callees_given(facts, names):
            defs = facts.project_functions(callee) + [  # a Trainer class counts as its body
                (f, n)
                for f in [facts, *facts.others]
                for n in f.nodes
                if isinstance(n, ast.ClassDef) and n.name == callee
            ]
            if not defs:
                unseen.append(callee)
            elif any(_calls_set_epoch(f, d, 3) for f, d in defs):
                followed = True
        if followed:
            continue
        returned = _returned_by(facts, call, names)
        if returned is not None:
            callers = facts.project.call_sites.get(returned, [])
            if any(_caller_sets_epoch(f, c, unseen) for f, c in callers):
                continue
            if not callers:
                yield finding(
                    facts,
                    call,
                    "sampler-without-set-epoch",
                    f"DistributedSampler is returned by `{returned.name}()`, whose callers are not "
                    "in the files checked: the doctor cannot see whether they call set_epoch().",
                    f"make sure the caller of `{returned.name}()` calls sampler.set_epoch(epoch) "
                    "(or loader.sampler.set_epoch(epoch)) every epoch, or check its file in the "
                    "same run.",
                    severity=WARNING,
                )
                continue
        if unseen:
            yield finding(
                facts,
                call,
                "sampler-without-set-epoch",
                f"DistributedSampler is passed to `{unseen[0]}()`, which is not defined in "
                "the files checked: the doctor cannot see whether it calls set_epoch().",
                f"make sure `{unseen[0]}()` calls sampler.set_epoch(epoch) every epoch, or "
                "check its file in the same run (`disttrain doctor script.py utils/`).",
                severity=WARNING,
            )
            continue
        epochs = _epoch_loop(facts, names)
        reader = facts
        if epochs is None and returned is not None:
            for f2, c2 in facts.project.call_sites.get(returned, []):
                # what the caller keeps it in: `loader = DataLoader(ds, sampler=make(...))`
                epochs, reader = _epoch_loop(f2, sampler_names(f2, c2)), f2
                if epochs is not None:
                    break
        yield finding(
            facts,
            call,
            "sampler-without-set-epoch",
            "DistributedSampler shuffles by epoch, but set_epoch() is never called: "
            "every epoch replays the same order.",
            "call sampler.set_epoch(epoch) at the start of each epoch, before iterating the DataLoader.",
            witness=f"DistributedSampler at {facts.path}:{call.lineno}, then a loop that reads it pass after "
            f"pass at {reader.path}:{epochs.lineno} -> every pass yields the same order"
            if epochs is not None
            else "",
        )


def _epoch_loop(facts: Facts, names: set[str]) -> ast.stmt | None:
    """A loop around a use of the sampler or its loader (a loop over it, or a call given
    it): each of its passes reads the loader anew."""
    for loop in facts.nodes:
        if not isinstance(loop, (ast.For, ast.AsyncFor, ast.While)):
            continue
        for n in (m for s in loop.body for m in ast.walk(s)):
            if (isinstance(n, (ast.For, ast.AsyncFor)) and mentions(n.iter, lambda w: w in names)) or (
                isinstance(n, ast.Call) and any(mentions(a, lambda w: w in names) for a in n.args)
            ):
                return loop
    return None


def _returned_by(facts: Facts, call: ast.Call, names: set[str]):
    """The function that builds the sampler and returns it, or the loader or dict that
    holds it (`return loader`, `return loader, sampler`); None otherwise."""
    fn = facts.scope_of(call)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for n in facts.scoped.get(fn, ()):
        if (
            isinstance(n, ast.Return)
            and n.value is not None
            and (n.value is call or any(ref(x) in names for x in ast.walk(n.value)))
        ):
            return fn
    return None


def _caller_sets_epoch(facts: Facts, call: ast.Call, unseen: list[str], depth: int = 2) -> bool:
    """A call of the function that returns the sampler sets its epoch: the caller's file
    calls set_epoch (`loader.sampler.set_epoch(epoch)`), hands what it got to a function
    that does, or returns it in turn to callers that do. Functions it hands it to that are
    defined in none of the files checked are added to `unseen`."""
    if facts.method_calls("set_epoch"):
        return True
    parent = facts.parents.get(call)
    got = (
        {r for t in getattr(parent, "targets", []) for x in ast.walk(t) if (r := ref(x))}
        if isinstance(parent, ast.Assign)
        else set()
    )
    for callee in _callees_given(facts, got):
        defs = facts.project_functions(callee)
        if not defs:
            unseen.append(callee)
        elif any(_calls_set_epoch(f, d, 3) for f, d in defs):
            return True
    outer = _returned_by(facts, call, got) if depth else None
    return outer is not None and any(
        _caller_sets_epoch(f, c, unseen, depth - 1) for f, c in facts.project.call_sites.get(outer, [])
    )


_EVAL_WORDS = {"val", "valid", "validation", "eval", "evaluation", "test", "testing", "dev"}


def is_eval_name(name: str) -> bool:
    return any(t in _EVAL_WORDS for t in re.split(r"[^a-z]+", name.lower()))


def sampler_names(facts: Facts, call: ast.Call) -> set[str]:
    """Every name the sampler is reachable by: its own (`sampler = DistributedSampler(...)`,
    or `... if distributed else None`), a kwargs dict holding it, the DataLoader built from
    it (`DataLoader(ds, **kwargs)`), a list it is appended to, and names copied from those."""
    parent = facts.parents.get(call)
    while isinstance(parent, (ast.keyword, ast.Dict, ast.Call, ast.IfExp)):
        parent = facts.parents.get(parent)
    names = {r for t in getattr(parent, "targets", []) if (r := ref(t))} if isinstance(parent, ast.Assign) else set()
    changed = True
    while changed:
        changed = False
        for n in facts.nodes:
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "append"
                and n.args
                and ref(n.args[0]) in names
                and (owner := ref(n.func.value))
                and owner not in names
            ):
                names.add(owner)  # `samplers.append(sampler)`
                changed = True
            if not isinstance(n, ast.Assign) or not _holds(facts, n.value, names):
                continue
            for t in n.targets:
                r = ref(t)
                if r and r not in names:
                    names.add(r)
                    changed = True
    return names


def _holds(facts: Facts, value: ast.AST, names: set[str]) -> bool:
    if isinstance(value, (ast.Name, ast.Attribute)):
        return ref(value) in names
    if isinstance(value, ast.Dict) or (
        isinstance(value, ast.Call) and (facts.qualname(value.func) or "").endswith("DataLoader")
    ):
        return any(ref(v) in names for v in ast.walk(value) if isinstance(v, (ast.Name, ast.Attribute)))
    return False


# Callees that only iterate or inspect a loader: never where set_epoch would hide.
_NOT_USER = {
    "DataLoader",
    "DistributedSampler",
    "len",
    "iter",
    "next",
    "enumerate",
    "zip",
    "print",
    "append",
    "extend",
    "insert",
    "add",
    "update",
    "setdefault",  # containers
    "isinstance",
    "list",
    "tuple",
    "dict",
    "set",
    "sorted",
    "range",
    "getattr",
    "hasattr",
    "tqdm",
    "trange",
    "islice",
    "cycle",
    "chain",
}


def _callees_given(facts: Facts, names: set[str]) -> list[str]:
    """Functions (own or unseen) that receive one of `names` as an argument."""
    out = []
    for n in facts.nodes:
        if not isinstance(n, ast.Call):
            continue
        values = list(n.args) + [k.value for k in n.keywords]
        if not any(ref(v) in names for v in values):
            continue
        name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else None
        q = facts.qualname(n.func) or ""
        if name and name not in _NOT_USER and not q.startswith(("torch.", "disttrain.", "tqdm.", "itertools.")):
            out.append(name)
    return out


def _calls_set_epoch(facts: Facts, func: ast.AST, depth: int) -> bool:
    for n in ast.walk(func):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_epoch":
            return True
        if depth and isinstance(n, ast.Call):
            callee = n.func.id if isinstance(n.func, ast.Name) else None
            if (
                callee
                and callee != getattr(func, "name", None)
                and any(_calls_set_epoch(f, d, depth - 1) for f, d in facts.project_functions(callee))
            ):
                return True
    return False
