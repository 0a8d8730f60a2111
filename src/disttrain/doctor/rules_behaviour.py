"""Behavioural rules: paths where ranks part ways, or end up with different state.

Each asks the data-flow core (dataflow.py, control_flow.py) rather than matching one
shape: which values are rank-local, which seeds differ per rank, which guards are true
on every rank in a launch mode. A finding names the path it is sure of and, at warning
severity, what it could not see. Each check takes `Facts` and yields `Finding`s.
"""

from __future__ import annotations

import ast
import re

from disttrain.doctor import guard_shapes
from disttrain.doctor.facts import Facts, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import WARNING, finding, rule
from disttrain.doctor.names import refs_in

_NONFINITE = ("isfinite", "isnan", "isinf", "nan", "inf", "finite")
_EXIT_CALLS = ("sys.exit", "exit", "quit", "os._exit")
_NONFINITE_PARTS = set(_NONFINITE) | {"nonfinite", "infinite", "isneginf", "isposinf"}


def _nonfinite_word(w: str) -> bool:
    """`isfinite`, `loss_is_nan`, `found_inf`: a part of the name, not a substring
    (`info_dict`, `inference_ckpt_path` hold "inf" and test nothing non-finite)."""
    return any(p.lower() in _NONFINITE_PARTS for p in re.split(r"_|(?<=[a-z])(?=[A-Z])", w))


def _program_distributed(facts: Facts) -> bool:
    return any(f.distributed for f in facts.project.component(facts))


def _exit_stmt(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Raise):
        return "raise"
    if isinstance(stmt, ast.Break):
        return "break"
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) in _EXIT_CALLS:
        return ast.unparse(stmt.value.func) + "()"
    return None


def _sources(facts: Facts, names: set[str], node: ast.stmt) -> set[str]:
    """The names the values of `names` were computed from in the same function, to a
    fixpoint (`loss_value = losses_reduced.item()`, `losses_reduced = sum(reduced.values())`,
    `reduced = utils.reduce_dict(loss_dict)`)."""
    scope = facts.scope_of(node)
    assigns = [
        n for n in facts.nodes if isinstance(n, ast.Assign) and n.lineno < node.lineno and facts.scope_of(n) is scope
    ]
    out = set(names)
    for _ in range(6):
        before = len(out)
        for n in assigns:
            if any(ref(t) in out for t in n.targets):
                out |= refs_in(n.value)
        if len(out) == before:
            break
    return out - names


def _reduced_before(facts: Facts, names: set[str], node: ast.stmt) -> bool:
    """One of `names` went through an all_reduce / reduce / gather earlier in the function:
    every rank then tests the same value."""
    scope = facts.scope_of(node)
    for c, q in facts.calls:
        if facts.scope_of(c) is not scope or c.lineno > node.lineno:
            continue
        last = q.rsplit(".", 1)[-1]
        if (
            last
            in (
                "all_reduce",
                "reduce",
                "all_gather",
                "gather",
                "reduce_mean",
                "all_reduce_mean",
                "reduce_value",
                "reduce_tensor",
                "reduce_dict",
            )
            or "reduce" in last.lower()
        ):
            parent = facts.parents.get(c)
            if any(ref(a) in names for a in c.args) or (
                isinstance(parent, ast.Assign) and any(ref(t) in names for t in parent.targets)
            ):
                return True
    return False


@rule(
    "rank-local-exit",
    ("P-LOOP-1", "P-DEBUG-1"),
    WARNING,
    "one rank exits on its own non-finite loss",
    """`if not math.isfinite(loss): sys.exit(1)` (or raise, or break) tests this rank's own
      loss: under data parallelism each rank sees a different batch, so one rank can leave
      while the others go on into the next collective (the gradient all-reduce, a barrier)
      and wait for it until the collective timeout, unless the launcher tears the whole job
      down when one worker fails (torchrun does; srun without --kill-on-bad-exit and
      hand-rolled launchers do not). A `break` leaves the loop on one rank only, which
      desynchronises every collective after it. All-reduce the flag first (MAX of
      `~isfinite`) so every rank takes the same decision.""",
)
def rank_local_exit(facts: Facts):
    if not _program_distributed(facts):
        return
    for node in facts.nodes:
        if not isinstance(node, ast.If) or not node.body:
            continue
        how = _exit_stmt(node.body[-1])
        if how is None or not mentions(node.test, _nonfinite_word):
            continue
        if facts.rank_guard(node) is not None:
            continue  # already a one-rank path: judged by the collective rules
        if _off_flag(facts, node.test):
            continue  # `if error_if_nonfinite and ...`: off by default and no caller turns it on
        loop = facts.enclosing_loop(node)
        if how == "break" and loop is None:
            continue
        names = refs_in(node.test)
        names |= _sources(facts, names, node)  # loss_value = loss.item(): loss too
        if _reduced_before(facts, names, node):
            continue
        yield finding(
            facts,
            node.body[-1],
            "rank-local-exit",
            f"`{how}` on this rank's own non-finite value (line {node.lineno}): the other "
            "ranks saw other batches, go on into the next collective and wait for this one "
            "until the timeout (unless the launcher kills the job when a worker fails).",
            "all_reduce the non-finite flag (ReduceOp.MAX) before the test, so every rank stops together.",
        )
    yield from _skipped_steps(facts)


def _skipped_steps(facts: Facts):
    """`except ...: continue` in a training loop under DDP/FSDP, before the step's
    backward: a rank whose batch fails (a file it cannot read) skips a step the others
    run, their gradient all-reduces pair up across steps and the last one waits."""
    if not (facts.project.wrap_kinds(facts) - {"dp"}):
        return
    for h in facts.nodes:
        if not (isinstance(h, ast.ExceptHandler) and h.body and isinstance(h.body[-1], ast.Continue)):
            continue
        loop = facts.enclosing_loop(h)
        if loop is None or facts.rank_guard(h) is not None:
            continue
        backward = next(
            (
                c
                for c in ast.walk(loop)
                if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute)
                and c.func.attr == "backward"
                and c.lineno > h.lineno
                and facts.enclosing_loop(c) is loop
            ),
            None,
        )
        if backward is not None:
            yield finding(
                facts,
                h.body[-1],
                "rank-local-exit",
                f"`continue` on this rank's own exception skips the step whose backward "
                f"(line {backward.lineno}) the other ranks run: their gradient all-reduces pair "
                "up across steps, and at the end one rank waits in a backward the others "
                "never join.",
                "skip the batch on every rank together (all_reduce a failure flag), or make "
                "the data path substitute a good sample instead of skipping the step.",
            )


def _off_flag(facts: Facts, test: ast.AST) -> bool:
    """A conjunct of `test` is a parameter of its function that defaults to False (or None)
    and that no call in the run passes: the branch cannot run on the paths the doctor sees."""
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)):
        return False
    fn = facts.scope_of(test)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    params = fn.args.args + fn.args.kwonlyargs
    defaults = dict(
        zip([a.arg for a in fn.args.args][len(fn.args.args) - len(fn.args.defaults) :], fn.args.defaults, strict=False)
    )
    defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=False) if d is not None})
    sites = facts.project.call_sites.get(fn, [])
    if not sites:
        return False  # its callers are out of view: one of them may turn it on
    bound = 1 if params and params[0].arg in ("self", "cls") else 0  # obj.f(x) passes self itself
    for v in test.values:
        if not isinstance(v, ast.Name):
            continue  # (not a parameter)
        name = v.id
        d = defaults.get(name)
        if d is None or not (isinstance(d, ast.Constant) and d.value in (False, None)):
            continue
        index = [a.arg for a in params].index(name) - bound
        if not any(
            any(k.arg in (name, None) for k in c.keywords)
            or len(c.args) > index
            or any(isinstance(a, ast.Starred) for a in c.args)
            for _, c in sites
        ):
            return True
    return False


_EMA_CALLS = (
    "ModelEma",
    "ModelEmaV2",
    "ModelEmaV3",
    "ExponentialMovingAverage",
    "EMA",
    "AveragedModel",
    "EMAModel",
    "ModelEMA",
    "LitEma",
)


@rule(
    "ema-before-broadcast",
    ("P-DDP-3",),
    WARNING,
    "an EMA copied from a per-rank random init before DDP's broadcast",
    """DistributedDataParallel broadcasts rank 0's parameters to every rank when it
      wraps the model; anything copied from the model before the wrap keeps this rank's
      own initialisation. With a seed that differs per rank (`torch.manual_seed(seed +
      rank)`, common for data augmentation) every rank initialises different weights, so
      an EMA (ModelEma, deepcopy(model)) built before the wrap starts from a different
      point on every rank, and rank 0's decays into its weights only slowly. Build the EMA
      after the wrap (from `model.module`), or seed the model's init identically on every
      rank.""",
)
def ema_before_broadcast(facts: Facts):
    seeded = facts.project.rank_seeded
    if seeded is None:
        return
    ddp = [w for w in facts.wraps if w.kind in ("ddp", "disttrain") and w.arg]
    for call, q in facts.calls:
        last = q.rsplit(".", 1)[-1]
        is_copy = last == "deepcopy" and _assigned_to_ema(facts, call)
        if last not in _EMA_CALLS and not is_copy:
            continue
        src = ref(call.args[0]) if call.args else None
        for w in ddp:
            if (
                src
                and (src == w.arg)
                and facts.scope_of(call) is w.scope
                and call.lineno < w.call.lineno
                and not facts.exclusive(call, w.call)
                and not _ema_reset_after(facts, call, w)
            ):
                yield finding(
                    facts,
                    call,
                    "ema-before-broadcast",
                    f"the EMA copies `{src}` before the DDP wrap (line {w.call.lineno}), and "
                    f"the seed differs per rank (line {seeded.lineno}): each rank's EMA "
                    "starts from its own random init, not from the weights DDP broadcasts.",
                    f"build the EMA after the wrap from `{w.target or src}.module`, or load "
                    "or broadcast the initial weights first.",
                )
                break


_EMA_RESETS = ("set", "copy_from", "load_state_dict", "sync")


def _ema_reset_after(facts: Facts, call: ast.Call, wrap) -> bool:
    """The EMA `call` makes is set again after the wrap (`model_ema.set(model)`, timm's
    ModelEmaV2): it then starts from the weights DDP broadcast."""
    parent = facts.parents.get(call)
    names = {ref(t) for t in parent.targets} - {None} if isinstance(parent, ast.Assign) else set()
    return any(
        isinstance(c.func, ast.Attribute)
        and c.func.attr in _EMA_RESETS
        and ref(c.func.value) in names
        and c.lineno > wrap.call.lineno
        for c, _ in facts.calls
    )


def _assigned_to_ema(facts: Facts, call: ast.Call) -> bool:
    parent = facts.parents.get(call)
    return isinstance(parent, ast.Assign) and any("ema" in (ref(t) or "").lower() for t in parent.targets)


@rule(
    "guard-true-on-every-rank",
    ("P-LOOP-1", "P-CKPT-2"),
    WARNING,
    "a rank guard or device on `--local_rank`, which torchrun never sets",
    """torchrun passes the local rank in the LOCAL_RANK environment variable, not as a
      `--local_rank` argument (only the deprecated torch.distributed.launch did). A script
      that reads its rank only from `args.local_rank` (default 0 or -1) sees the default on
      every rank under torchrun: `if args.local_rank in [-1, 0]: torch.save(...)` is then
      true on every rank, and they all write the same file at once, and
      `torch.cuda.set_device(args.local_rank)` binds every rank to the same GPU. Read
      `int(os.environ["LOCAL_RANK"])` (and guard on the global rank).""",
)
def guard_true_on_every_rank(facts: Facts):
    yield from _guards_that_do_not_hold(facts)
    default = _local_rank_argument(facts)
    if default is None or facts.project.reads_local_rank_env or _starts_own_processes(facts):
        return
    from disttrain.doctor.rules_io import torch_saves

    for call in facts.calls_to("torch.cuda.set_device"):
        if call.args and "local_rank" in ast.unparse(call.args[0]) and facts.rank_guard(call) is None:
            yield finding(
                facts,
                call,
                "guard-true-on-every-rank",
                f"the device comes from `--local_rank` (default {default}), and nothing reads "
                "LOCAL_RANK from the environment: under torchrun (which sets only the "
                "environment) every rank binds the same GPU; torch.distributed.launch from torch "
                "2.0 passes `--local-rank`, which this parser does not define.",
                "read local_rank = int(os.environ['LOCAL_RANK']) (torchrun and launch both set it).",
            )
    for call in torch_saves(facts, wrappers=True):
        test = _guard_test_naming(facts, call, "local_rank")
        if test is None:
            continue
        yield finding(
            facts,
            call,
            "guard-true-on-every-rank",
            f"this save is guarded by `{ast.unparse(test)}`, but `--local_rank` defaults to "
            f"{default} and nothing reads LOCAL_RANK from the environment: under torchrun "
            "(which sets only the environment) the guard is true on every rank, and each "
            "writes the same file.",
            "read local_rank = int(os.environ['LOCAL_RANK']) and guard on the global rank (dist.get_rank() == 0).",
        )


def _guards_that_do_not_hold(facts: Facts):
    """`if is_main and a or b:` bodies that touch shared state, and folder resets with no
    guard before a barrier (guard_shapes.py); a reset inside such an `if` is reported once.
    No other sign of several processes is asked for: the rank test or the barrier is one."""
    reported = []
    for node, message, fix in guard_shapes.or_precedence(facts):
        reported.append(node)
        yield finding(facts, node, "guard-true-on-every-rank", message, fix)
    for node, message, fix in guard_shapes.unguarded_reset(facts):
        if not any(a in reported for a in facts.ancestors(node)):
            yield finding(facts, node, "guard-true-on-every-rank", message, fix)


def _starts_own_processes(facts: Facts) -> bool:
    """A loop that sets `args.local_rank` and starts a process with it (LSGM's
    `for rank in range(n): args.local_rank = rank; Process(...).start()`): the program is
    its own launcher, not torchrun's, and each process gets its own local rank."""
    for f in facts.project.component(facts):
        for loop in (n for n in f.nodes if isinstance(n, ast.For)):
            inner = list(ast.walk(loop))
            sets = any(
                isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Attribute) and t.attr == "local_rank" for t in n.targets)
                for n in inner
            )
            starts = any(
                isinstance(n, ast.Call) and (ref(n.func) or "").rsplit(".", 1)[-1] in ("Process", "start")
                for n in inner
            )
            if sets and starts:
                return True
    return False


def _local_rank_argument(facts: Facts):
    for f in facts.project.component(facts):
        for c in f.method_calls("add_argument"):
            names = [a.value for a in c.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(n.lstrip("-").replace("-", "_") == "local_rank" for n in names):
                d = kwarg(c, "default")
                if isinstance(d, ast.Constant):
                    return d.value
                if (
                    isinstance(d, ast.UnaryOp)
                    and isinstance(d.operand, ast.Constant)
                    and isinstance(d.operand.value, (int, float))
                ):  # `default=-1`; `-"x"` would raise
                    return -d.operand.value
    return None


def _guard_test_naming(facts: Facts, node: ast.AST, word: str, depth: int = 2):
    """The rank-guard test around `node` (or around the guarded call sites of its function)
    that mentions `word`."""
    child = node
    for a in facts.ancestors(node):
        if isinstance(a, (ast.If, ast.IfExp)) and child is not a.test and word in ast.unparse(a.test):
            return a.test
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if depth:
                for f2, c in facts.project.call_sites.get(a, []):
                    t = _guard_test_naming(f2, c, word, depth - 1)
                    if t is not None:
                        return t
            return None
        child = a
    return None


@rule(
    "full-state-dict-on-every-gpu",
    ("P-CKPT-3", "P-FSDP-7"),
    WARNING,
    "a full FSDP state dict gathered onto every rank's GPU",
    """FULL_STATE_DICT without `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`
      (or DCP's StateDictOptions(full_state_dict=True) without cpu_offload=True) all-gathers
      the whole unsharded model onto every rank's GPU before the save, even when only rank
      0 writes it: the memory sharding saved comes back at every checkpoint, and large
      models run out of memory there. Offload to CPU and keep the copy on rank 0 only.""",
)
def full_state_dict_on_every_gpu(facts: Facts):
    for call in facts.calls_to("FullStateDictConfig"):
        if not is_const(kwarg(call, "offload_to_cpu"), True):
            yield finding(
                facts,
                call,
                "full-state-dict-on-every-gpu",
                "FullStateDictConfig without offload_to_cpu=True: the full model is gathered "
                "onto every rank's GPU at each save.",
                "FullStateDictConfig(offload_to_cpu=True, rank0_only=True).",
            )
    for call in facts.calls_to("StateDictOptions"):
        parent = facts.parents.get(call)
        while isinstance(parent, ast.keyword):
            parent = facts.parents.get(parent)
        q = (facts.qualname(parent.func) or "") if isinstance(parent, ast.Call) else ""
        if q.rsplit(".", 1)[-1].startswith("set_") or is_const(kwarg(call, "broadcast_from_rank0"), True):
            continue  # loading: rank 0's full copy is broadcast and sharded, nothing is gathered
        if is_const(kwarg(call, "full_state_dict"), True) and not is_const(kwarg(call, "cpu_offload"), True):
            yield finding(
                facts,
                call,
                "full-state-dict-on-every-gpu",
                "StateDictOptions(full_state_dict=True) without cpu_offload=True: the full "
                "model is gathered onto every rank's GPU.",
                "add cpu_offload=True (and broadcast_from_rank0 when loading).",
            )
    for call in facts.method_calls("state_dict_type"):
        if len(call.args) == 2 and not call.keywords and "FULL_STATE_DICT" in ast.unparse(call.args[1]):
            yield finding(
                facts,
                call,
                "full-state-dict-on-every-gpu",
                "FULL_STATE_DICT with no FullStateDictConfig: by default the full model is "
                "gathered onto every rank's GPU.",
                "pass FullStateDictConfig(offload_to_cpu=True, rank0_only=True).",
            )


_NCCL_EARLY = (
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "broadcast_object_list",
    "monitored_barrier",
)


@rule(
    "collective-before-set-device",
    ("P-INIT-2",),
    WARNING,
    "a NCCL collective before torch.cuda.set_device",
    """A collective before the rank binds its GPU runs on whatever device is current:
      cuda:0 on every rank, or the device NCCL guesses from the rank (`rank %
      device_count`, "devices used by this process are currently unknown"). The
      communicator is then created on the wrong GPU (several ranks on one device), which
      hangs or serialises the job. Call torch.cuda.set_device(local_rank) before
      init_process_group's first collective.""",
)
def collective_before_set_device(facts: Facts):
    from disttrain.doctor.names import SET_DEVICE

    binds = facts.calls_to(*SET_DEVICE)
    if not binds:
        return
    for call, q in facts.calls:
        if not q.startswith("torch.distributed.") or q.rsplit(".", 1)[-1] not in _NCCL_EARLY:
            continue
        scope = facts.scope_of(call)
        later = [
            b for b in binds if facts.scope_of(b) is scope and b.lineno > call.lineno and not facts.exclusive(b, call)
        ]
        earlier = [
            b for b in binds if facts.scope_of(b) is scope and b.lineno < call.lineno and not facts.exclusive(b, call)
        ]
        if later and not earlier and facts.enclosing_loop(call) is None:
            yield finding(
                facts,
                call,
                "collective-before-set-device",
                f"{q.rsplit('.', 1)[-1]}() runs before torch.cuda.set_device (line "
                f"{later[0].lineno}): NCCL builds its communicator on the current device "
                "(cuda:0, or a guess from the rank), not this rank's GPU.",
                "call torch.cuda.set_device(local_rank) first.",
            )
