"""Rules about the parallel wrapper: DP/DDP/FSDP, the optimizer, the wrapper's state dict.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.control_flow import distributed_test
from disttrain.doctor.facts import Facts, arg, base_ref, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import ADVICE, ERROR, WARNING, finding, path_witness, rule
from disttrain.doctor.rules_io import torch_saves
from disttrain.doctor.strategy_paths import apart


@rule(
    "data-parallel",
    ("P-DDP-1",),
    WARNING,
    "nn.DataParallel instead of DistributedDataParallel",
    """DataParallel is one process driving all GPUs with threads: it re-replicates the
      parameters before every forward, gathers outputs on device 0 and is limited by the
      GIL and to one node (about 2.3x on 4 GPUs where DDP reaches 3.6x). Use
      DistributedDataParallel with one process per GPU, launched by torchrun.""",
)
def data_parallel(facts: Facts):
    if facts.distributed:
        return  # reported as data-parallel-in-ddp instead
    for w in facts.wraps:
        if w.kind == "dp":
            yield finding(
                facts,
                w.call,
                "data-parallel",
                "nn.DataParallel runs every GPU from one process (threads, GIL, outputs "
                "gathered on cuda:0): slower than DDP and single-node only.",
                "use DistributedDataParallel, one process per GPU, launched with torchrun.",
            )


@rule(
    "data-parallel-in-ddp",
    ("P-DDP-3",),
    ERROR,
    "DataParallel inside a multi-process (DDP) script",
    """In a script that runs one process per GPU, DataParallel makes every process
      replicate the model over all visible GPUs: ranks fight over the same devices and,
      nested in DDP, gradients are reduced twice over overlapping replicas. DDP alone does
      the whole job. A DataParallel in a branch that excludes every DDP/FSDP wrap
      (`if args.distributed: DDP(...) else: DataParallel(...)`), or that sits under the
      opposite answer to the same mode test (`if rank == -1:` ... `if rank != -1:`), is
      the single-process fallback and is not reported.""",
)
def data_parallel_in_ddp(facts: Facts):
    if not facts.distributed:
        return
    dp_names = {w.target: w for w in facts.wraps if w.kind == "dp" and w.target}
    multi = [w.call for w in facts.wraps if w.kind != "dp"]
    from disttrain.doctor.control_flow import SOLO

    for w in facts.wraps:
        if w.kind == "dp" and multi and all(apart(facts, w.call, m) for m in multi):
            continue  # the DataParallel branch is the one that runs without DDP/FSDP
        if w.kind == "dp" and facts.rank_guard(w.call) == SOLO:
            continue  # `if RANK == -1 and device_count() > 1:` a single-process path
        if w.kind == "dp" and _under_count_one_when_distributed(facts, w.call):
            continue  # timm's `if args.num_gpu > 1:` after `if args.distributed: args.num_gpu = 1`
        if w.kind == "dp":
            yield finding(
                facts,
                w.call,
                "data-parallel-in-ddp",
                "DataParallel in a multi-process script: each rank replicates the model over every visible GPU.",
                "remove the DataParallel wrap; wrap once with DistributedDataParallel(model, device_ids=[local_rank]).",
                witness=path_witness(
                    facts,
                    [("every rank of the multi-process run: DataParallel", w.call)],
                    "each rank runs a replica on every visible GPU, N ranks times over",
                ),
            )
        elif (
            w.kind in ("ddp", "fsdp1")
            and isinstance(w.call.args[0], ast.Call)
            and (facts.qualname(w.call.args[0].func) or "").endswith("DataParallel")
        ):
            pass  # the inner DataParallel call is reported above
        elif w.kind in ("ddp", "fsdp1") and w.arg in dp_names and w.arg is not None:
            inner = dp_names[w.arg]
            if (
                inner.call.lineno < w.call.lineno
                and not apart(facts, inner.call, w.call)
                and not _under_count_one_when_distributed(facts, inner.call)
            ):
                yield finding(
                    facts,
                    w.call,
                    "data-parallel-in-ddp",
                    f"`{w.arg}` is already a DataParallel (line {inner.call.lineno}) and is wrapped again by DDP.",
                    "wrap the bare module once with DistributedDataParallel.",
                    witness=path_witness(
                        facts,
                        [("DataParallel", inner.call), ("DDP around it", w.call)],
                        "each rank's forward scatters over every visible GPU inside DDP",
                    ),
                )


def _under_count_one_when_distributed(facts: Facts, node: ast.AST) -> bool:
    """`node` runs under `if COUNT > 1:` (or `>= 2`) where COUNT is set to 1 on the
    multi-process path (`if args.distributed: args.num_gpu = 1`, or `cfg.n_gpu = 1` beside
    the init_process_group call, in any file of the program: DPR's set-up): that branch is
    the single-process mode, never taken by the ranks of a distributed run."""
    forced = _counts_pinned_to_one(facts)
    child = node
    for a in facts.ancestors(node):
        if (
            isinstance(a, ast.If)
            and child in a.body
            and isinstance(a.test, ast.Compare)
            and len(a.test.ops) == 1
            and (_last_word(ref(a.test.left)) in forced)
        ):
            op, c = a.test.ops[0], a.test.comparators[0]
            if isinstance(c, ast.Constant) and (
                (isinstance(op, ast.Gt) and c.value == 1) or (isinstance(op, ast.GtE) and c.value == 2)
            ):
                return True
        child = a
    return False


def _last_word(r: str | None) -> str | None:
    return r.rsplit(".", 1)[-1] if r else None


def _counts_pinned_to_one(facts: Facts) -> set[str]:
    """Names (last word) set to 1 in a block that is the multi-process path: the body of
    `if args.distributed:`, or a block that also calls init_process_group."""
    out: set[str] = set()
    files = facts.project.component(facts) if facts.project is not None else [facts]
    for f in files:
        inits = {id(f.parents.get(c)) for c in f.calls_to("torch.distributed.init_process_group")}
        for n in f.nodes:
            if not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value == 1):
                continue
            parent = f.parents.get(n)
            in_dist_branch = isinstance(parent, ast.If) and n in parent.body and distributed_test(parent.test) == 1
            beside_init = any(isinstance(s, ast.Expr) and id(s) in inits for s in _block_of(parent, n))
            if in_dist_branch or beside_init:
                out |= {w for t in n.targets if (w := _last_word(ref(t)))}
    return out


def _block_of(parent: ast.AST | None, n: ast.stmt) -> list[ast.stmt]:
    for field in ("body", "orelse", "finalbody"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and n in block:
            return block
    return []


def is_optimizer(q: str) -> bool:
    parts = q.split(".")
    last = parts[-1]
    if last in ("ZeroRedundancyOptimizer",):
        return True
    return "optim" in parts[:-1] and "lr_scheduler" not in parts and last[:1].isupper() and last not in ("Optimizer",)


def param_refs(call: ast.Call) -> set[str]:
    """Modules whose parameters an optimizer receives: `model.parameters()` -> model."""
    params = arg(call, 0, "params")
    out: set[str] = set()
    if params is None:
        return out
    for n in ast.walk(params):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("parameters", "named_parameters")
        ):
            r = base_ref(n.func.value)
            if r:
                out.add(r)
    return out


@rule(
    "optimizer-before-wrap",
    ("P-FSDP-7",),
    ERROR,
    "optimizer built before the FSDP wrap",
    """Build the optimizer from the wrapped model. FSDP replaces (flattens or shards) the
      parameters, so an optimizer built before the wrap updates tensors the model no longer
      uses and training silently does nothing. DDP is not reported: it keeps the module's
      own Parameter objects, so an optimizer built before the DDP wrap updates exactly what
      DDP trains (apex's amp.initialize even needs it that way). An optimizer and a wrap in
      different branches of one if/elif/else never meet.""",
)
def optimizer_before_wrap(facts: Facts):
    opts = [(c, param_refs(c)) for c, q in facts.calls if is_optimizer(q)]
    for w in facts.wraps:
        if w.kind in ("dp", "ddp") or not w.arg:
            continue
        for call, refs in opts:
            hits = {r for r in refs if r == w.arg or r.startswith(w.arg + ".")}
            if (
                not hits
                or facts.scope_of(call) is not w.scope
                or call.lineno >= w.call.lineno
                or facts.exclusive(call, w.call)
            ):
                continue
            rebuilt = any(
                facts.scope_of(c) is w.scope
                and c.lineno > w.call.lineno
                and any(r == w.arg or r.startswith(w.arg + ".") or r == w.target for r in rs)
                for c, rs in opts
            )
            if rebuilt:
                continue
            name = {"fsdp1": "FSDP", "fsdp2": "fully_shard", "disttrain": "disttrain.wrap"}[w.kind]
            yield finding(
                facts,
                call,
                "optimizer-before-wrap",
                f"the optimizer takes `{w.arg}`'s parameters at line {call.lineno}, before the "
                f"{name} wrap at line {w.call.lineno}: sharding replaces them, so the optimizer "
                "updates stale tensors.",
                f"build the optimizer after the {name} wrap, from the wrapped model's parameters().",
                witness=path_witness(
                    facts,
                    [(f"the optimizer takes `{w.arg}`'s parameters", call), (f"{name} replaces them", w.call)],
                    "optimizer.step() updates tensors the wrapped model no longer trains",
                ),
            )


@rule(
    "find-unused-parameters",
    ("P-DDP-4",),
    ADVICE,
    "find_unused_parameters=True without a dynamic graph",
    """find_unused_parameters=True makes DDP traverse the autograd graph after every
      forward to find parameters that got no gradient, costing 10-20% throughput. It is
      only needed when forward skips parameters (branches, early exits). The error
      "Expected to have finished reduction in the prior iteration" is better fixed by
      making every parameter take part in the loss. Advice: the flag costs time, never a
      wrong result, and the reasons it is needed often lie out of view (parameters
      frozen after the wrap, a loop that drops an input, a forward in another file).""",
)
def find_unused_parameters(facts: Facts):
    in_view = any(f.functions.get("forward") for f in facts.project.component(facts))
    dynamic = _has_dynamic_forward(facts)
    for w in facts.wraps:
        if not in_view and not _builtin_module(facts, w):
            continue  # the model is defined out of view: the doctor cannot tell whether it branches
        flag = kwarg(w.call, "find_unused_parameters")
        if w.kind == "ddp" and flag is not None and is_const(flag, True) and not dynamic:
            yield finding(
                facts,
                flag,
                "find-unused-parameters",
                "find_unused_parameters=True, yet no forward() here branches: the graph "
                "walk after every forward costs 10-20% throughput for nothing.",
                "drop it (the default is False); keep it only if forward really skips "
                "parameters, and then say so with `# disttrain: ignore[find-unused-parameters]`.",
            )


def _builtin_module(facts: Facts, w) -> bool:
    """The wrapped module is a torch.nn one built right there (`DDP(nn.Linear(...))`)."""
    node, at = w.call.args[0], w.call.lineno
    for _ in range(4):
        while (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("to", "cuda", "cpu")
        ):
            node = node.func.value
        if isinstance(node, ast.Name):  # model = nn.Linear(...).cuda(); DDP(model)
            assigns = [
                n
                for n in facts.nodes
                if isinstance(n, ast.Assign)
                and n.lineno < at
                and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
            ]
            if not assigns:
                return False
            last = max(assigns, key=lambda n: n.lineno)
            node, at = last.value, last.lineno
            continue
        if isinstance(node, ast.Call) and node.args and (facts.qualname(node.func) or "").endswith("DataParallel"):
            node = node.args[0]  # DDP(DataParallel(model)): the module inside (DPR's helper)
            continue
        break
    return isinstance(node, ast.Call) and (facts.qualname(node.func) or "").startswith("torch.nn.")


def _has_dynamic_forward(facts: Facts) -> bool:
    """A forward() in this script with a branch or an early return: the only sign of a
    dynamic graph that the source can show (a model defined elsewhere shows none)."""
    for d in facts.functions.get("forward", []):
        for n in ast.walk(d):
            if isinstance(n, (ast.If, ast.IfExp)):
                return True
            if isinstance(n, ast.Return) and n is not d.body[-1]:
                return True
    return False


@rule(
    "ddp-state-dict-prefix",
    ("P-CKPT-4",),
    WARNING,
    "saving the state_dict of the DDP wrapper",
    """`ddp_model.state_dict()` prefixes every key with `module.`, so the checkpoint no
      longer loads into a plain model (missing/unexpected keys). Save the unwrapped
      weights: `model.module.state_dict()`.""",
)
def ddp_state_dict_prefix(facts: Facts):
    wrapped = [w for w in facts.wraps if w.kind in ("ddp", "dp") and w.target and not _resumed_into_wrapper(facts, w)]
    if not wrapped:
        return
    for save in torch_saves(facts):
        obj = arg(save, 0, "obj")
        if obj is None:
            continue
        sources = [obj] + _assigned_values(facts, obj, save)
        for src in sources:
            for n in ast.walk(src):
                if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "state_dict"):
                    continue
                owner = base_ref(n.func.value) if isinstance(n.func.value, ast.Call) else ref(n.func.value)
                if _unwrap_branch(facts, n, save):
                    continue  # `m.module.state_dict() if hasattr(m, "module") else m.state_dict()`
                for w in wrapped:
                    if (
                        owner == w.target
                        and facts.scope_of(n) is w.scope
                        and n.lineno > w.call.lineno
                        and not facts.exclusive(n, w.call)
                    ):
                        yield finding(
                            facts,
                            n,
                            "ddp-state-dict-prefix",
                            f"`{owner}` is the {'DDP' if w.kind == 'ddp' else 'DataParallel'} "
                            f"wrapper (line {w.call.lineno}): its state_dict keys all start "
                            "with `module.`.",
                            f"save {owner}.module.state_dict() instead.",
                        )


_LOAD_WORDS = ("load", "resume", "restore", "restart")


def _resumed_into_wrapper(facts: Facts, w) -> bool:
    """After the wrap, the script loads checkpoints back into the wrapper itself
    (`model.load_state_dict(...)`, `utils.load_checkpoint(model, path)`,
    `restart_from_checkpoint(path, state_dict=model)`): the `module.` keys it saves are the
    keys it loads, so the prefix breaks nothing the script does."""
    for c, q in facts.calls:
        if facts.scope_of(c) is not w.scope or c.lineno <= w.call.lineno or facts.exclusive(c, w.call):
            continue
        if isinstance(c.func, ast.Attribute) and c.func.attr == "load_state_dict" and ref(c.func.value) == w.target:
            return True
        name = q.rsplit(".", 1)[-1].lower()
        if any(x in name for x in _LOAD_WORDS) and any(
            ref(a) == w.target for a in list(c.args) + [k.value for k in c.keywords]
        ):
            return True
    return False


def _unwrap_branch(facts: Facts, node: ast.AST, stop: ast.AST) -> bool:
    """True when `node` sits in a branch chosen by a test about `.module` (unwrapping)."""
    for a in facts.ancestors(node):
        if a is stop or isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            return False
        if isinstance(a, (ast.If, ast.IfExp)) and (
            mentions(a.test, lambda w: w == "module") or "module" in ast.unparse(a.test)
        ):
            return True
    return False


def _assigned_values(facts: Facts, obj: ast.AST, before: ast.Call) -> list[ast.expr]:
    """Values assigned to `obj` (or its items) in the same scope before `before`:
    `ckpt = {"model": m.state_dict()}` and `ckpt["model"] = m.state_dict()`."""
    name = ref(obj)
    if name is None:
        return []
    scope = facts.scope_of(before)
    out = []
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign) and n.lineno <= before.lineno and facts.scope_of(n) is scope:
            for t in n.targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if ref(base) == name:
                    out.append(n.value)
    return out
