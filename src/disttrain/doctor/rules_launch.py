"""Rules about launching and setting up ranks: process group, port, device, sampler.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast
import re

from disttrain.doctor.facts import DISTTRAIN_INITS, Facts, arg, has_star_kwargs, kwarg, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, rule


# Backends that simulate a process group in one process: nothing to wait for.
_NO_COLLECTIVE_BACKENDS = ("fake", "local_tensor")


@rule("init-without-timeout", ("P-INIT-1",), WARNING,
      "init_process_group without an explicit timeout",
      """torch's default collective timeout is 10 minutes (30 for some backends), so a
      rank that died or hangs stalls every other rank for that long before anything is
      reported. Pass `timeout=datetime.timedelta(minutes=...)`, shorter than the default
      (5-10 minutes for elastic jobs). The `fake` and `local_tensor` backends (tracing,
      tests) run no real collectives and need none.""")
def init_without_timeout(facts: Facts):
    for call in facts.calls_to("init_process_group"):
        backend = arg(call, 0, "backend")
        if isinstance(backend, ast.Constant) and backend.value in _NO_COLLECTIVE_BACKENDS:
            continue  # no real collectives run, so nothing can hang
        if kwarg(call, "timeout") is None and not has_star_kwargs(call) and len(call.args) < 3:
            yield finding(facts, call, "init-without-timeout",
                          "init_process_group() has no timeout: a dead or hung rank stalls the "
                          "others for torch's default 10-30 minutes.",
                          "pass timeout=datetime.timedelta(minutes=10) (5-10 min for elastic jobs).")


_TCP_PORT = re.compile(r"^tcp://[^/]*:\d+")


@rule("hardcoded-master-port", ("P-INIT-4",), WARNING,
      "MASTER_PORT hard-coded in the script",
      """A fixed rendezvous port collides as soon as two jobs share a host ("Address
      already in use"). Let the launcher pick it: `torchrun --standalone` or `disttrain
      run` choose a free port and export MASTER_ADDR/MASTER_PORT; read them from the
      environment with `init_method="env://"` (the default).""")
def hardcoded_master_port(facts: Facts):
    msg = "MASTER_PORT is fixed in the script: two jobs on one host collide (Address already in use)."
    fix = "remove it and launch with `torchrun --standalone` or `disttrain run`, which pick a free port."
    for node in facts.nodes:
        # os.environ["MASTER_PORT"] = "29500"
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if _environ_key(facts, t) == "MASTER_PORT":
                    yield finding(facts, node, "hardcoded-master-port", msg, fix)
        # os.environ.setdefault("MASTER_PORT", "12355") / os.putenv("MASTER_PORT", ...)
        if isinstance(node, ast.Call) and len(node.args) == 2 and \
                isinstance(node.args[1], ast.Constant) and _is_const_str(node.args[0], "MASTER_PORT"):
            q = facts.qualname(node.func) or ""
            if q.endswith("environ.setdefault") or q.endswith("environ.update") or q == "os.putenv":
                yield finding(facts, node, "hardcoded-master-port", msg, fix)
    for call in facts.calls_to("init_process_group"):
        method = kwarg(call, "init_method")
        if isinstance(method, ast.Constant) and isinstance(method.value, str) and \
                _TCP_PORT.match(method.value):
            yield finding(facts, method, "hardcoded-master-port",
                          f"init_method={method.value!r} fixes the rendezvous port: two jobs on one "
                          "host collide.", fix)


def _environ_key(facts: Facts, target: ast.AST) -> str | None:
    if isinstance(target, ast.Subscript) and (facts.qualname(target.value) or "").endswith("os.environ"):
        key = target.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    return None


def _is_const_str(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


@rule("mp-spawn", ("P-INIT-4",), WARNING,
      "mp.spawn used where torchrun fits",
      """`torch.multiprocessing.spawn` hand-rolls what torchrun does better: torchrun sets
      RANK/LOCAL_RANK/WORLD_SIZE, picks the rendezvous, restarts failed workers (elastic)
      and spans nodes. Read the rank from the environment and launch with
      `torchrun --standalone --nproc-per-node=N script.py` (or `disttrain run`).""")
def mp_spawn(facts: Facts):
    for call in facts.calls_to("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes"):
        yield finding(facts, call, "mp-spawn",
                      "mp.spawn() launches the ranks by hand: no elastic restart, no multi-node, "
                      "and the rendezvous port is yours to manage.",
                      "read RANK/LOCAL_RANK/WORLD_SIZE from the environment and launch with "
                      "`torchrun --standalone --nproc-per-node=N` or `disttrain run`.")


_SET_DEVICE = ("torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device",
               "init_device_mesh")  # a CUDA mesh binds cuda:LOCAL_RANK itself


@rule("missing-set-device", ("P-INIT-2",), ERROR,
      "no torch.cuda.set_device before CUDA use under torchrun",
      """Each rank must bind its own GPU with `torch.cuda.set_device(local_rank)` before
      any CUDA allocation. Without it, `.cuda()`, `"cuda"` and NCCL's default device all
      mean cuda:0, so every rank allocates on (and runs out of) the first GPU.""")
def missing_set_device(facts: Facts):
    if not facts.distributed:
        return
    binds = facts.calls_to(*_SET_DEVICE, *DISTTRAIN_INITS) + _visible_devices_assignments(facts)
    uses = _cuda_uses(facts)
    if not uses:
        return
    if not binds:
        unindexed = [u for u in uses if u[1]]
        pg_bound = any(kwarg(c, "device_id") is not None for c in facts.calls_to("init_process_group"))
        if pg_bound and not unindexed:
            return  # every use names its device, and the group is bound by device_id=
        if not unindexed:  # every allocation names its device: only NCCL's own device is unbound
            if _gloo_only(facts):
                return
            yield finding(facts, uses[0][0], "missing-set-device",
                          "every CUDA use here names its device, but no device is bound: NCCL's "
                          "own work (barrier, object collectives) still defaults to cuda:0.",
                          "call torch.cuda.set_device(local_rank) (or pass device_id= to "
                          "init_process_group).", severity=WARNING)
            return
        node, _ = unindexed[0]
        yield finding(facts, node, "missing-set-device",
                      "CUDA is used under torchrun but the script never binds a device: every "
                      "rank defaults to cuda:0.",
                      "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) right at start-up, "
                      "before init_process_group and any CUDA tensor.")
        return
    for node, unindexed in uses:
        if not unindexed:
            continue
        scope = facts.scope_of(node)
        same = [b for b in binds if facts.scope_of(b) is scope]
        # A bind in another function (a setup() helper) is assumed to run first.
        if same and all(b.lineno > node.lineno for b in same) and len(same) == len(binds):
            yield finding(facts, node, "missing-set-device",
                          f"CUDA is used here before torch.cuda.set_device (line {same[0].lineno}): "
                          "this allocation lands on cuda:0 on every rank.",
                          "move torch.cuda.set_device(local_rank) before the first CUDA use.")
            return


def _gloo_only(facts: Facts) -> bool:
    inits = facts.calls_to("init_process_group")
    return bool(inits) and all(isinstance(b := arg(c, 0, "backend"), ast.Constant) and b.value == "gloo"
                               for c in inits)


def _visible_devices_assignments(facts: Facts) -> list[ast.AST]:
    return [n for n in facts.nodes if isinstance(n, ast.Assign)
            and any(_environ_key(facts, t) == "CUDA_VISIBLE_DEVICES" for t in n.targets)]


def _cuda_uses(facts: Facts) -> list[tuple[ast.AST, bool]]:
    """(node, unindexed) for each CUDA use, in source order. Unindexed uses (`.cuda()`,
    `"cuda"`) mean "the current device"; indexed ones (`cuda:{local_rank}`) name it."""
    out: list[tuple[ast.AST, bool]] = []
    for node in facts.nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "cuda" and facts.qualname(node.func) != "torch.cuda":
            out.append((node, not node.args and not node.keywords))
        elif isinstance(node, ast.Constant) and node.value == "cuda" and _is_device_use(facts, node):
            out.append((node, True))
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and _is_indexed_cuda(node):
            out.append((node, False))
    out.sort(key=lambda u: (u[0].lineno, u[0].col_offset))
    return out


def _is_device_use(facts: Facts, node: ast.AST) -> bool:
    """"cuda" as a device (torch.device("cuda"), .to("cuda"), device="cuda"), not as a
    string compared against (`device.type == "cuda"`) or a backend/amp device_type."""
    parent = facts.parents.get(node)
    while isinstance(parent, ast.IfExp):  # "cuda" if torch.cuda.is_available() else "cpu"
        node, parent = parent, facts.parents.get(parent)
    if isinstance(parent, ast.Call):
        q = facts.qualname(parent.func) or ""
        if q == "torch.device" or (isinstance(parent.func, ast.Attribute) and parent.func.attr == "to"):
            return node in parent.args
    if isinstance(parent, ast.keyword) and parent.arg == "device":
        return True
    return False


def _is_indexed_cuda(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and re.fullmatch(r"cuda:\d+", node.value) is not None
    first = node.values[0] if node.values else None  # type: ignore[attr-defined]
    return isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value == "cuda:"


@rule("sampler-without-set-epoch", ("P-DATA-2",), ERROR,
      "DistributedSampler without set_epoch in the epoch loop",
      """A shuffling DistributedSampler draws its order from (seed, epoch). Unless the
      loop calls `sampler.set_epoch(epoch)` at the start of every epoch, the epoch stays 0
      and every epoch replays exactly the same order. Samplers with shuffle=False or for
      evaluation (named val/valid/eval/test, or feeding such a loader) need none. A
      sampler (or its loader) passed to a function is followed into it when the function
      is defined in this file or in the other files checked in the same run; passed to a
      function the doctor cannot see, it is a warning that says so.""")
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
        names = _sampler_names(facts, call)
        dataset = ref(arg(call, 0, "dataset") or call)
        if any(_is_eval_name(n) for n in names | {dataset or ""}):
            continue  # evaluation order does not matter
        unseen, followed = [], False
        for callee in _callees_given(facts, names):
            defs = facts.project_functions(callee) + [  # a Trainer class counts as its body
                (f, n) for f in [facts, *facts.others] for n in f.nodes
                if isinstance(n, ast.ClassDef) and n.name == callee]
            if not defs:
                unseen.append(callee)
            elif any(_calls_set_epoch(f, d, 3) for f, d in defs):
                followed = True
        if followed:
            continue
        if unseen:
            yield finding(facts, call, "sampler-without-set-epoch",
                          f"DistributedSampler is passed to `{unseen[0]}()`, which is not defined in "
                          "the files checked: the doctor cannot see whether it calls set_epoch().",
                          f"make sure `{unseen[0]}()` calls sampler.set_epoch(epoch) every epoch, or "
                          "check its file in the same run (`disttrain doctor script.py utils/`).",
                          severity=WARNING)
            continue
        yield finding(facts, call, "sampler-without-set-epoch",
                      "DistributedSampler shuffles by epoch, but set_epoch() is never called: "
                      "every epoch replays the same order.",
                      "call sampler.set_epoch(epoch) at the start of each epoch, before "
                      "iterating the DataLoader.")


_EVAL_WORDS = {"val", "valid", "validation", "eval", "evaluation", "test", "testing", "dev"}


def _is_eval_name(name: str) -> bool:
    return any(t in _EVAL_WORDS for t in re.split(r"[^a-z]+", name.lower()))


def _sampler_names(facts: Facts, call: ast.Call) -> set[str]:
    """Every name the sampler is reachable by: its own, a kwargs dict holding it, the
    DataLoader built from it (`DataLoader(ds, **kwargs)`), and names copied from those."""
    parent = facts.parents.get(call)
    while isinstance(parent, (ast.keyword, ast.Dict, ast.Call)):
        parent = facts.parents.get(parent)
    names = {r for t in getattr(parent, "targets", []) if (r := ref(t))} \
        if isinstance(parent, ast.Assign) else set()
    changed = True
    while changed:
        changed = False
        for n in facts.nodes:
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
    if isinstance(value, ast.Dict) or (isinstance(value, ast.Call) and
                                       (facts.qualname(value.func) or "").endswith("DataLoader")):
        return any(ref(v) in names for v in ast.walk(value) if isinstance(v, (ast.Name, ast.Attribute)))
    return False


# Callees that only iterate or inspect a loader: never where set_epoch would hide.
_NOT_USER = {"DataLoader", "DistributedSampler", "len", "iter", "next", "enumerate", "zip", "print",
             "isinstance", "list", "tuple", "dict", "set", "sorted", "range", "getattr", "hasattr",
             "tqdm", "trange", "islice", "cycle", "chain"}


def _callees_given(facts: Facts, names: set[str]) -> list[str]:
    """Functions (own or unseen) that receive one of `names` as an argument."""
    out = []
    for n in facts.nodes:
        if not isinstance(n, ast.Call):
            continue
        values = list(n.args) + [k.value for k in n.keywords]
        if not any(ref(v) in names for v in values):
            continue
        name = n.func.id if isinstance(n.func, ast.Name) else \
            n.func.attr if isinstance(n.func, ast.Attribute) else None
        q = facts.qualname(n.func) or ""
        if name and name not in _NOT_USER and not q.startswith(("torch.", "disttrain.", "tqdm.",
                                                                 "itertools.")):
            out.append(name)
    return out


def _calls_set_epoch(facts: Facts, func: ast.AST, depth: int) -> bool:
    for n in ast.walk(func):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_epoch":
            return True
        if depth and isinstance(n, ast.Call):
            callee = n.func.id if isinstance(n.func, ast.Name) else None
            if callee and callee != getattr(func, "name", None) and any(
                    _calls_set_epoch(f, d, depth - 1) for f, d in facts.project_functions(callee)):
                return True
    return False
