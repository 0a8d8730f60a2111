"""The device-binding rule: every rank binds its own GPU before it uses CUDA.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable

from disttrain.doctor.facts import DISTTRAIN_INITS, Facts, arg, kwarg
from disttrain.doctor.findings import ERROR, WARNING, finding, path_witness, rule
from disttrain.doctor.names import LIBRARY_DEVICE_BINDS, SOLO
from disttrain.doctor.names import SET_DEVICE as _SET_DEVICE
from disttrain.doctor.rules_launch import environ_key


@rule(
    "missing-set-device",
    ("P-INIT-2",),
    ERROR,
    "no torch.cuda.set_device before CUDA use under torchrun",
    """Each rank must bind its own GPU with `torch.cuda.set_device(local_rank)` before
      any CUDA allocation. Without it, `.cuda()`, `"cuda"` and NCCL's default device all
      mean cuda:0, so every rank allocates on (and runs out of) the first GPU.""",
)
def missing_set_device(facts: Facts):
    if not facts.distributed:
        return
    binds = facts.calls_to(*_SET_DEVICE, *DISTTRAIN_INITS, *LIBRARY_DEVICE_BINDS) + _visible_devices_assignments(facts)
    uses = _cuda_uses(facts)
    yield from _launch_path_without_bind(facts, binds)
    if not uses:
        return
    elsewhere = [(f, c) for f, c in facts.project.binds_device(facts) if f is not facts]
    if not binds and elsewhere:
        return  # bound by another file's init helper (init_distributed_mode in utils.py)
    if not binds:
        # the single-process branch (`else` of `if distributed:`) has one process: cuda:0 is its device
        unindexed_uses = [u for u in uses if u[1] and facts.rank_guard(u[0]) != SOLO]
        pg_bound = any(kwarg(c, "device_id") is not None for c in facts.calls_to("init_process_group"))
        if pg_bound and not unindexed_uses:
            return  # every use names its device, and the group is bound by device_id=
        if not unindexed_uses:  # every allocation names its device: only NCCL's own device is unbound
            if _gloo_only(facts) or not _object_collectives(facts):
                return  # tensor collectives run on their tensors' devices
            yield finding(
                facts,
                uses[0][0],
                "missing-set-device",
                "every CUDA use here names its device, but no device is bound: the object "
                "collectives this program calls (all_gather_object, broadcast_object_list) "
                "stage their data on the current device, cuda:0 on every rank.",
                "call torch.cuda.set_device(local_rank) (or pass device_id= to init_process_group).",
                severity=WARNING,
            )
            return
        node, _ = unindexed_uses[0]
        if _unseen_device_binder(facts):
            return  # timm's `utils.init_distributed_device(args)`: named for what it binds
        helper = _unseen_init_helper(facts)
        if helper or not any(f.calls_to("init_process_group") for f in facts.project.files):
            what = f"`{helper}()`" if helper else "the code that starts the process group"
            yield finding(
                facts,
                node,
                "missing-set-device",
                "CUDA is used under torchrun and nothing in the files checked binds a device; "
                f"{what} is out of view, so the doctor cannot see whether it calls "
                "torch.cuda.set_device. If not, every rank defaults to cuda:0.",
                "make sure each rank calls torch.cuda.set_device(local_rank) at start-up "
                "(check the helper's file in the same run).",
                severity=WARNING,
            )
            return
        starts_here = any(facts.scope_of(c) is facts.scope_of(node) for c in facts.calls_to("init_process_group"))
        if not starts_here and not _entry_in_view(facts):
            if _an_entry_of_the_run_binds(facts):
                return  # KAIR, Stark: the entry script in view binds the device, then reaches this
                # file through an import out of view or importlib
            yield finding(
                facts,
                node,
                "missing-set-device",
                "CUDA is used under torchrun and nothing in the files checked binds a device, "
                "but the script that runs this code is not among them (no `__main__` block or "
                "top-level code): if it does not call torch.cuda.set_device first, every rank "
                "defaults to cuda:0.",
                "check the entry script in the same run, or bind the device in the set-up helper here.",
                severity=WARNING,
            )
            return
        yield finding(
            facts,
            node,
            "missing-set-device",
            "CUDA is used under torchrun but the script never binds a device: every rank defaults to cuda:0.",
            "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) right at start-up, "
            "before init_process_group and any CUDA tensor.",
            witness=path_witness(
                facts,
                [("every rank, with no set_device on the way: a CUDA use", node)],
                "all ranks allocate on cuda:0 (out of memory, or NCCL's ranks on one GPU)",
            ),
        )
        return
    for node, unindexed in uses:
        if not unindexed or _leaves_before_ranks(facts, node):
            continue
        scope = facts.scope_of(node)
        # a bind in the other branch of an if/else (CodeT5: `if local_rank == -1: device =
        # torch.device("cuda") else: set_device(...)`) is not after this use on any path
        same = [b for b in binds if facts.scope_of(b) is scope and not facts.exclusive(b, node)]
        # A bind in another function (a setup() helper) is assumed to run first.
        if same and all(b.lineno > node.lineno for b in same) and len(same) == len(binds):
            yield finding(
                facts,
                node,
                "missing-set-device",
                f"CUDA is used here before torch.cuda.set_device (line {same[0].lineno}): "
                "this allocation lands on cuda:0 on every rank.",
                "move torch.cuda.set_device(local_rank) before the first CUDA use.",
                witness=path_witness(
                    facts,
                    [("a CUDA use", node), ("set_device", same[0])],
                    "the allocation before it lands on cuda:0 on every rank",
                ),
            )
            return


def _unseen_init_helper(facts: Facts) -> str | None:
    """A call into code out of view whose name says it sets up distribution
    (`utils.init_distributed_mode(args)`, `setup_ddp()`), in this file or another of the
    program (efficientvit's entry script calls `setup.setup_dist_env(args.gpu)`, out of
    view, before the trainer in view uses CUDA)."""
    for f in [facts, *(g for g in facts.project.component(facts) if g is not facts)]:
        for _c, q in f.calls:
            last = q.rsplit(".", 1)[-1].lower()
            if (
                ("dist" in last or "ddp" in last or "setup" in last or "init" in last)
                and not q.startswith(("torch.", "disttrain."))
                and last not in facts.project.defs
                and last not in ("init_process_group",)
                and (f is facts or "dist" in last or "ddp" in last)
            ):
                return q
    return None


def _an_entry_of_the_run_binds(facts: Facts) -> bool:
    """A script among the files checked (a `__main__` block) binds a device itself or
    through the project's set-up function it calls."""
    for f in facts.project.files:
        if f is facts or not any(isinstance(s, ast.If) and "__name__" in ast.unparse(s.test) for s in f.tree.body):
            continue
        program = facts.project.component(f)
        if any(g.calls_to(*_SET_DEVICE) for g in program):
            return True
    return False


def _entry_in_view(facts: Facts) -> bool:
    """Some file of the program runs code itself: a `__main__` block or a call at module
    level (a script), not only definitions a caller out of view uses (efficientvit's
    trainer and dist helpers, run by a script not checked). A use in the function that
    starts the group needs no entry: the set-up is right there."""
    for f in facts.project.component(facts):
        for stmt in f.tree.body:
            if isinstance(stmt, ast.If) and "__name__" in ast.unparse(stmt.test):
                return True
            if isinstance(stmt, (ast.Expr, ast.For, ast.While, ast.With)) and any(
                isinstance(n, ast.Call) for n in ast.walk(stmt)
            ):
                return True  # a bare `main()`, a training loop at top level
            if (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Call)
                and (
                    f.project.resolve(f, stmt.value)
                    or (f.qualname(stmt.value.func) or "").endswith(
                        ("init_process_group", "DistributedDataParallel", "to", "cuda")
                    )
                )
            ):
                return True  # `model = build(...)`, `model = DDP(...)`: script code, not a library's logger
    return False


def _unseen_device_binder(facts: Facts) -> str | None:
    """A call into code out of view whose name says it sets up the device for distributed
    work (`init_distributed_device`, `setup_device`): assumed to bind it."""
    for _, q in facts.calls:
        last = q.rsplit(".", 1)[-1].lower()
        if (
            "device" in last
            and any(w in last for w in ("init", "setup", "set_up"))
            and not q.startswith(("torch.", "disttrain."))
            and last not in facts.project.defs
        ):
            return q
    return None


def _launch_path_without_bind(facts: Facts, binds: list) -> Iterable:
    """An if/elif chain of launch paths (torchrun's env://, SLURM, a single process) where
    one path binds the device and another one that starts the group or reads the rank from
    the environment does not, with no bind after the chain: that path runs on cuda:0."""
    calls = [b for b in binds if isinstance(b, ast.Call)]
    for node in facts.nodes:
        parent = facts.parents.get(node)
        if not isinstance(node, ast.If) or isinstance(parent, ast.If) and node in parent.orelse:
            continue
        branches, cur = [], node
        while True:
            branches.append((cur, cur.body))
            if len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If):
                cur = cur.orelse[0]
                continue
            if cur.orelse:
                branches.append((cur, cur.orelse))
            break
        if len(branches) < 2:
            continue
        bound = [any(_within(facts, c, body) for c in calls) for _, body in branches]
        if not any(bound) or all(bound):
            continue
        scope = facts.scope_of(node)
        end = max(getattr(node, "end_lineno", node.lineno), node.lineno)
        if any(facts.scope_of(c) is scope and c.lineno > end and not facts.exclusive(c, node) for c in calls):
            continue  # bound after the chain, on every path
        for (_test_node, body), ok in zip(branches, bound, strict=False):
            if ok or not _starts_ranks(facts, body):
                continue
            where = next(
                c for c in calls if any(_within(facts, c, b) for (_, b), k in zip(branches, bound, strict=False) if k)
            )
            first = body[0]
            yield finding(
                facts,
                first,
                "missing-set-device",
                "this launch path reads the rank from the environment (or starts the process "
                f"group, or wraps with DDP) but never binds a device; only another path does "
                f"(line {where.lineno}), so here every rank allocates on cuda:0.",
                "call torch.cuda.set_device(local_rank) on this path too, or once after the if/elif chain.",
                severity=WARNING,
            )


def _leaves_before_ranks(facts: Facts, node: ast.AST) -> bool:
    """`node` sits in a branch that returns (or raises) without starting the process group
    or reading the rank: the single-process fallback of an init helper (SparK's `elif
    'RANK' not in os.environ: device = torch.empty(1).cuda().device; return`), which no
    rank of a multi-process run takes, so the bind after it is not missing there."""
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, ast.If):
            for block in (a.body, a.orelse):
                if (
                    child in block
                    and block
                    and isinstance(block[-1], (ast.Return, ast.Raise))
                    and not _starts_ranks(facts, block)
                ):
                    return True
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        child = a
    return False


def _within(facts: Facts, node: ast.AST, body: list) -> bool:
    return any(a in body for a in [node, *facts.ancestors(node)])


def _starts_ranks(facts: Facts, body: list) -> bool:
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Constant) and n.value in ("LOCAL_RANK", "RANK"):
                return True
            if isinstance(n, ast.Call) and (facts.qualname(n.func) or "").endswith(
                ("init_process_group", "DistributedDataParallel")
            ):
                return True  # starts the group, or wraps with DDP (which needs the device bound)
    return False


def _object_collectives(facts: Facts) -> bool:
    return any(
        f.calls_to("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
        for f in facts.project.component(facts)
    )


def _gloo_only(facts: Facts) -> bool:
    inits = facts.calls_to("init_process_group")
    return bool(inits) and all(isinstance(b := arg(c, 0, "backend"), ast.Constant) and b.value == "gloo" for c in inits)


def _visible_devices_assignments(facts: Facts) -> list[ast.Assign]:
    return [
        n
        for n in facts.nodes
        if isinstance(n, ast.Assign) and any(environ_key(facts, t) == "CUDA_VISIBLE_DEVICES" for t in n.targets)
    ]


def _cuda_uses(facts: Facts) -> list[tuple[ast.expr, bool]]:
    """(node, unindexed) for each CUDA use, in source order. Unindexed uses (`.cuda()`,
    `"cuda"`) mean "the current device"; indexed ones (`cuda:{local_rank}`) name it."""
    out: list[tuple[ast.expr, bool]] = []
    for node in facts.nodes:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "cuda"
            and facts.qualname(node.func) != "torch.cuda"
        ):
            out.append((node, not node.args and not node.keywords))
        elif isinstance(node, ast.Constant) and node.value == "cuda" and _is_device_use(facts, node):
            parent = facts.parents.get(node)
            named = (
                isinstance(parent, ast.Call)
                and (facts.qualname(parent.func) or "") == "torch.device"
                and (len(parent.args) > 1 or kwarg(parent, "index") is not None)
            )
            out.append((node, not named))  # torch.device("cuda", local_rank) names its device
        elif isinstance(node, (ast.Constant, ast.JoinedStr)) and _is_indexed_cuda(node):
            out.append((node, False))
    out.sort(key=lambda u: (u[0].lineno, u[0].col_offset))
    return out


def _is_device_use(facts: Facts, node: ast.AST) -> bool:
    """ "cuda" as a device (torch.device("cuda"), .to("cuda"), device="cuda"), not as a
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
