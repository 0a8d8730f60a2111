"""Rules about what ranks write and read: logs, checkpoints, loads.

Each check takes `Facts` and yields `Finding`s; each stays silent unless the source
shows the pitfall (a false positive is a bug: when in doubt, say nothing).
"""

from __future__ import annotations

import ast

from disttrain.doctor.control_flow import LOCAL
from disttrain.doctor.facts import Facts, arg, has_star_kwargs, is_const, kwarg, mentions, ref
from disttrain.doctor.findings import ERROR, WARNING, finding, rule
from disttrain.doctor.log_lines import error_report, per_rank_message
from disttrain.doctor.names import rank_aware_logging, word
from disttrain.doctor.save_paths import (
    accelerator_saves,
    atomic_moves,
    checkpoint_copies,
    ends_the_process,
    in_temporary_dir,
    is_rank_word,
    moves_path,
    per_process_word,
    per_rank_variable,
)

# Per-rank messages are legitimate: every rank reports its own warnings and errors.
_LOG_METHODS = ("info", "debug", "log")
_LOGGER_NAMES = ("logger", "log", "logging", "_logger", "LOGGER", "LOG", "_log")


def _log_calls(facts: Facts):
    """print to stdout, logging.info/debug, logger.info/debug, wandb.init/log,
    SummaryWriter(): the outputs that should come from one rank only. Logger calls count
    only when the file itself makes the logger and shows no rank-aware set-up."""
    project = facts.project
    rank_aware = project.rank_aware_logging(facts) or project.logging_set_up_out_of_view(facts)
    own = _own_loggers(facts)
    # info()/debug() of a logging nothing configures (no handler, no level) are dropped at
    # the root's default WARNING on every rank: nothing to repeat
    configured = _logging_configured(facts)
    # `builtins.print` replaced by a rank-aware one (setup_for_distributed), in any file
    # of the run, or a `print` of the file's own: print is not the builtin one.
    builtin_print = project.print_override_for(facts) is None and not _shadows_print(facts)
    # A distributed set-up out of view may replace it too: print is not judged, except
    # before the process group starts in the same function (no rank to filter by yet).
    unseen_set_up = project.distributed_set_up_out_of_view(facts) is not None
    for call, q in facts.calls:
        if q == "print":
            if not builtin_print or (unseen_set_up and not _before_group_start(facts, call)):
                continue
            target = kwarg(call, "file")
            # print(..., file=f) writes a file (a CSV log), judged as a file, not a log line
            if target is None or (facts.qualname(target) or "").endswith("stdout"):
                yield call, "print()"
        elif (
            q.rsplit(".", 1)[-1] in _LOG_METHODS
            and isinstance(call.func, ast.Attribute)
            and (ref(call.func.value) or "").split(".")[-1] in _LOGGER_NAMES
        ):
            if not rank_aware and configured and (q.startswith("logging.") or ref(call.func.value) in own):
                yield call, f"{ast.unparse(call.func)}()"
        elif q in ("wandb.init", "wandb.log") or q.endswith("SummaryWriter"):
            if not _bound_to_a_dummy(facts, call.func):
                yield call, f"{q.rsplit('.', 1)[-1] if 'Summary' in q else q}()"


def _bound_to_a_dummy(facts: Facts, func: ast.AST) -> bool:
    """The called name is also imported as a do-nothing class (`from .metrics import
    SummaryWriterDummy as SummaryWriter` on the other ranks, fast-autoaugment)."""
    name = func.id if isinstance(func, ast.Name) else None
    return name is not None and any(
        isinstance(n, ast.ImportFrom)
        and any(
            (a.asname or a.name) == name and any(w in a.name.lower() for w in ("dummy", "noop", "null"))
            for a in n.names
        )
        for n in facts.nodes
    )


_LOGGING_SET_UP = (
    "basicConfig",
    "setLevel",
    "addHandler",
    "dictConfig",
    "fileConfig",
    "set_verbosity",
    "set_verbosity_info",
    "set_verbosity_debug",
)


def _logging_configured(facts: Facts) -> bool:
    """Some file of the program sets a logging level or handler (or calls a set-up out of
    view, which logging_set_up_out_of_view reports)."""
    return any(q.rsplit(".", 1)[-1] in _LOGGING_SET_UP for f in facts.project.component(facts) for _, q in f.calls)


def _before_group_start(facts: Facts, call: ast.Call) -> bool:
    """`call` comes before an init_process_group of its own function."""
    scope = facts.scope_of(call)
    return any(facts.scope_of(c) is scope and c.lineno > call.lineno for c in facts.calls_to("init_process_group"))


def _unused_helper(facts: Facts, node: ast.AST) -> bool:
    """`node` is in a module-level function that nothing in the run refers to (Latte's
    `utils.find_model`, used by sampling scripts not checked), and no entry point by its
    name (`main`, `train`, `run`: a script's own, whoever calls it)."""
    scope = facts.scope_of(node)
    return (
        isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef))
        and facts.parents.get(scope) is facts.tree
        and scope.name not in facts.project.referenced_names
        and not reached_from_view(facts, node)
    )


def _imported_in_view(facts: Facts) -> bool:
    """Another file of the run imports this module (`from util import utils`): its users
    are in view."""
    stem = facts.path.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
    return any(
        f is not facts
        and any(
            (
                isinstance(n, ast.ImportFrom)
                and ((n.module or "").rsplit(".", 1)[-1] == stem or any(a.name == stem for a in n.names))
            )
            or (isinstance(n, ast.Import) and any(a.name.rsplit(".", 1)[-1] == stem for a in n.names))
            for n in f.nodes
        )
        for f in facts.project.component(facts)
    )


def _shadows_print(facts: Facts) -> bool:
    """The file defines or assigns its own `print` at module level."""
    for stmt in facts.tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "print":
            return True
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "print" for t in stmt.targets):
            return True
    return False


def _own_loggers(facts: Facts) -> set[str]:
    """Names bound in this file to `logging.getLogger(...)`: a logger imported from
    another module (torchtitan's `from ...logging import logger`) is set up there."""
    out = set()
    packages = {v.split(".")[0] for v in facts.aliases.values()} - {"logging", "__main__"}
    for call in facts.calls_to("logging.getLogger"):
        name = call.args[0] if call.args else None
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.split(".")[0] in packages:
            continue  # a library's logger (`getLogger("detectron2")`): the library sets it up
        parent = facts.parents.get(call)
        if isinstance(parent, ast.Assign):
            out |= {r for t in parent.targets if (r := ref(t))}
    return out


_rank_aware_logging = rank_aware_logging  # shared with the data-flow core (names.py)


@rule(
    "unguarded-log",
    ("P-LOOP-1",),
    WARNING,
    "logging or print without a rank guard",
    """Every rank runs the whole script, so an unguarded print/logger.info/wandb.log
      appears world-size times (and wandb.init or SummaryWriter creates one run per rank).
      Only rank 0 logs: guard with `if rank == 0:` and log globally reduced values. print
      always counts; logger calls count only for a logger made in the file (or `logging.*`)
      when the file shows no rank-aware set-up (a logging filter, a rank in the format, a
      level chosen by rank or set on the main process only). A guard on the LOCAL rank
      (LOCAL_RANK, local_rank, a variable read from it) still logs once per node.""",
)
def unguarded_log(facts: Facts):
    if not (facts.distributed or facts.calls_to("lightning.fabric.Fabric", "lightning_fabric.Fabric")):
        return  # a Fabric script is launched on several ranks by `fabric run`
    for call, what in _log_calls(facts):
        if per_rank_message(facts, call):
            continue  # the line names its rank (or pid): one distinct line per rank is the intent
        if _unused_helper(facts, call):
            continue  # no file of the run calls it: whether every rank does is out of view
        kind = facts.rank_guard(call)
        if kind is None and what == "print()" and error_report(facts, call):
            continue  # each failing rank reports its own failure
        if kind == LOCAL:
            yield finding(
                facts,
                call,
                "unguarded-log",
                f"{what} is guarded by the local rank only: on several nodes, local rank "
                "0 of every node logs, so each line appears once per node.",
                "guard it with the global rank (`if dist.get_rank() == 0:`).",
            )
        elif kind is None:
            yield finding(
                facts,
                call,
                "unguarded-log",
                f"{what} runs on every rank: each line appears world-size times.",
                "guard it with `if rank == 0:` (or a rank-zero-only helper).",
            )


def torch_saves(facts: Facts, wrappers: bool = False) -> list[ast.Call]:
    """torch.save calls; with `wrappers`, also the calls of the project's functions that
    hand their arguments to torch.save (`utils.save_on_master(ckpt, path)`)."""
    out = facts.calls_to("torch.save")
    if wrappers:
        project = facts.project
        for c, q in facts.calls:
            name = q.rsplit(".", 1)[-1]
            if (
                name in project.save_wrappers
                and c not in out
                and project.resolve(facts, c)
                and not _inside(facts, c, name)
            ):
                out.append(c)
    return out


def _inside(facts: Facts, node: ast.AST, name: str) -> bool:
    s = facts.scope_of(node)
    return getattr(s, "name", None) == name


def _save_path(call: ast.Call, facts: Facts | None = None) -> ast.AST | None:
    if facts is not None and not (facts.qualname(call.func) or "").endswith("torch.save"):
        q = (facts.qualname(call.func) or "").rsplit(".", 1)[-1]
        i = facts.project.save_wrappers.get(q, 1)
        return (
            call.args[i]
            if len(call.args) > i and not any(isinstance(a, ast.Starred) for a in call.args[: i + 1])
            else None
        )
    return arg(call, 1, "f")


def reached_from_view(facts: Facts, node: ast.AST) -> bool:
    """The function around `node` is called from code the doctor sees (or is the module,
    an entry point handed to a launcher, or a `main`)."""
    scope = facts.scope_of(node)
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    project = facts.project
    if scope.name in project.entry_points or scope.name in ("main", "train", "run") or scope in project.call_sites:
        return True
    return False


def unguarded_call_site(facts: Facts, node: ast.AST) -> tuple[Facts, ast.Call] | None:
    """A call, in a distributed file of the program, of the function around `node` that
    no rank test guards (`save_state(model, path)` in train.py's loop, where the other
    call sites sit under `if rank == 0:`); None when every call site is guarded, when
    the function has none in view, or `node` is at module level. For a function in a
    file that shows nothing distributed itself, only a call site no test at all leads to
    counts (`if not cfg.enable_fsdp: save(...)` may be the single-process path)."""
    scope = facts.scope_of(node)
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for f, c in facts.project.call_sites.get(scope, []):
        if f.distributed and f.rank_guard(c) is None and (facts.distributed or _unconditional(f, c)):
            return f, c
    return None


def _unconditional(facts: Facts, node: ast.AST) -> bool:
    """No `if`, conditional expression, `try` or `while` between `node` and its function."""
    for a in facts.ancestors(node):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
        if isinstance(a, (ast.If, ast.IfExp, ast.Try, ast.While, ast.BoolOp)):
            return False
    return True


def _path_text(path: ast.AST | None) -> str:
    return ast.unparse(path)[:60] if path is not None else "?"


@rule(
    "unguarded-save",
    ("P-LOOP-1", "P-CKPT-2"),
    ERROR,
    "torch.save without a rank guard",
    """Every rank runs the whole script, so an unguarded torch.save has world-size
      processes writing the same file at once: a torn or corrupt checkpoint. Only rank 0
      writes (after a barrier for readers); per-rank files must carry the rank in their
      name. A function whose every call site is guarded is guarded. A guard on the LOCAL
      rank (LOCAL_RANK, local_rank, gpu_id read from LOCAL_RANK) is a warning: on several
      nodes sharing a filesystem, each node's local rank 0 writes the same file.""",
)
def unguarded_save(facts: Facts):
    for call in torch_saves(facts):
        path = _save_path(call)
        if path is not None and (
            mentions(path, per_process_word)
            or _is_buffer(facts, path)
            or per_rank_variable(facts, path, call, per_process_word)
        ):
            continue  # one file per rank, or memory: no two writers share a file
        kind = facts.rank_guard(call)
        site = unguarded_call_site(facts, call) if kind is None else None
        if not facts.distributed and kind != LOCAL and site is None:
            continue  # a local-rank guard alone says several processes (LLaVA under the HF Trainer)
        if kind == LOCAL:
            yield finding(
                facts,
                call,
                "unguarded-save",
                "torch.save is guarded by the local rank only: on several nodes sharing a "
                "filesystem, local rank 0 of every node writes the same file at once.",
                "guard it with the global rank (`if dist.get_rank() == 0:`); keep local "
                "rank 0 only for node-local disks.",
                severity=WARNING,
            )
        elif kind is None and (site is not None or reached_from_view(facts, call)):
            save = f"torch.save to `{_path_text(path)}` at {facts.path}:{call.lineno}"
            by = f"`{word(site[1].func)}()` called at {site[0].path}:{site[1].lineno}, then " if site else ""
            yield finding(
                facts,
                call,
                "unguarded-save",
                "torch.save runs on every rank: world-size processes write the same file at once.",
                "save on rank 0 only (`if rank == 0:`), then dist.barrier() before anyone reads it.",
                witness=f"every rank, with no rank test on the way: {by}{save} -> world-size processes "
                "write one file at once (a torn checkpoint)",
            )
        elif kind is None and not (_unused_helper(facts, call) and _imported_in_view(facts)):
            # (a helper of a module the run imports, and nothing in it refers to: never called)
            fn = facts.scope_of(call).name  # type: ignore[attr-defined]
            yield finding(
                facts,
                call,
                "unguarded-save",
                f"torch.save has no rank guard here, and `{fn}()` is called from code "
                "the doctor cannot see (no call site in the files checked): if that "
                "caller does not guard it, world-size processes write the same file.",
                f"guard the save with `if rank == 0:`, or check `{fn}()`'s callers in the same run.",
                severity=WARNING,
            )


@rule(
    "non-atomic-save",
    ("P-CKPT-2",),
    WARNING,
    "torch.save straight to the final checkpoint path",
    """A crash or preemption during torch.save leaves a half-written file under the
      checkpoint's real name, and the next resume loads garbage. Write to a temporary
      name in the same directory, then `os.replace(tmp, path)`: readers see the old
      checkpoint or the new one, never half of one.""",
)
def non_atomic_save(facts: Facts):
    moves = atomic_moves(facts)
    for call in torch_saves(facts, wrappers=True) + accelerator_saves(facts):
        path = _save_path(call, facts)
        if (
            path is None
            or _is_buffer(facts, path)
            or _atomic_writer(facts, path)
            or in_temporary_dir(facts, call, path)
            or ends_the_process(facts, call)
        ):
            continue
        scope = facts.scope_of(call)
        if any(facts.scope_of(m) is scope and m.lineno >= call.lineno and moves_path(facts, m, path) for m in moves):
            continue
        if moves and mentions(path, lambda w: "tmp" in w.lower() or "temp" in w.lower()):
            continue  # written to a temporary name that a helper moves into place
        if not (facts.qualname(call.func) or "").endswith("torch.save"):
            name = ast.unparse(call.func)
            yield finding(
                facts,
                call,
                "non-atomic-save",
                f"{name}() hands this path to torch.save, which writes the final "
                "checkpoint path directly: a crash mid-write leaves a corrupt checkpoint "
                "under the real name.",
                'save to f"{path}.tmp" in the same directory, then os.replace(tmp, path).',
            )
            continue
        yield finding(
            facts,
            call,
            "non-atomic-save",
            "torch.save writes the final checkpoint path directly: a crash mid-write "
            "leaves a corrupt checkpoint under the real name.",
            'save to f"{path}.tmp" in the same directory, then os.replace(tmp, path).',
        )
    for c in checkpoint_copies(facts, torch_saves(facts, wrappers=True), lambda s: _save_path(s, facts)):
        yield finding(
            facts,
            c,
            "non-atomic-save",
            "this copy of a checkpoint writes its target straight under "
            "the final name: a crash mid-copy leaves a torn file there.",
            "copy to a temporary name in the same directory, then os.replace it into place.",
        )
    yield from _folder_saves(facts, moves)


# What a `save_pretrained` of these writes is a small JSON (a config, a tokenizer's
# vocabulary), saved next to the weights: the weights' save is the one reported.
_METADATA = ("config", "cfg", "tokenizer", "processor", "processing", "extractor")


def _folder_saves(facts: Facts, moves: list) -> list:
    """`model.save_pretrained(output_dir)` (transformers, diffusers, PEFT) writes the
    weight and config files one by one into the final folder: a crash part-way leaves a
    folder that loads as a model with torn or missing weights. Not reported when the
    folder is a temporary one, the function moves it into place afterwards, or the
    object saved is a config, tokenizer or processor."""
    out = []
    for call in facts.method_calls("save_pretrained"):
        owner = (ref(call.func.value) or "").rsplit(".", 1)[-1].lower()  # type: ignore[attr-defined]
        if any(w in owner for w in _METADATA):
            continue
        folder = call.args[0] if call.args else kwarg(call, "save_directory")
        if folder is None or mentions(folder, lambda w: "tmp" in w.lower() or "temp" in w.lower()):
            continue
        scope = facts.scope_of(call)
        if any(facts.scope_of(m) is scope and m.lineno >= call.lineno for m in moves):
            continue
        out.append(
            finding(
                facts,
                call,
                "non-atomic-save",
                "save_pretrained writes the files straight into the final folder: a crash "
                "mid-write leaves a folder that loads with torn or missing weights.",
                "save_pretrained into a temporary folder next to it, then os.replace it into place.",
            )
        )
    return out


def _atomic_writer(facts: Facts, node: ast.AST) -> bool:
    """The file object comes from a context manager that writes aside and renames on exit
    (`with flashy.utils.write_and_rename(path) as f`, `atomic_write(path)`)."""
    name = ref(node)
    return bool(name) and any(
        isinstance(n, ast.withitem)
        and n.optional_vars is not None
        and ref(n.optional_vars) == name
        and isinstance(n.context_expr, ast.Call)
        and any(
            w in (facts.qualname(n.context_expr.func) or "").rsplit(".", 1)[-1].lower() for w in ("rename", "atomic")
        )
        for n in facts.nodes
    )


_BUFFERS = ("BytesIO", "TemporaryFile", "SpooledTemporaryFile")


def _is_buffer(facts: Facts, node: ast.AST) -> bool:
    """An in-memory or anonymous temporary file (`io.BytesIO()`, `with
    tempfile.TemporaryFile() as f`) is no checkpoint: it needs no atomic replace, and
    what is loaded from it is bytes a rank just serialised."""

    def made_here(value: ast.AST) -> bool:
        return isinstance(value, ast.Call) and (facts.qualname(value.func) or "").endswith(_BUFFERS)

    if isinstance(node, ast.Call):
        return made_here(node)
    name = ref(node)
    if name is None:
        return False
    for n in facts.nodes:
        if isinstance(n, ast.Assign) and any(ref(t) == name for t in n.targets) and made_here(n.value):
            return True
        if (
            isinstance(n, ast.withitem)
            and n.optional_vars is not None
            and ref(n.optional_vars) == name
            and made_here(n.context_expr)
        ):
            return True
    return False


@rule(
    "load-without-map-location",
    ("P-CKPT-5",),
    WARNING,
    "torch.load without map_location",
    """Without map_location, torch.load puts every tensor back on the device it was
      saved from, usually cuda:0: every rank then loads the whole checkpoint onto the
      first GPU (out of memory, or silently on the wrong device). Load with
      `map_location="cpu"` (or the rank's own device). A file named by the rank (each
      rank's own shard, saved from its own device) is not reported.""",
)
def load_without_map_location(facts: Facts):
    if facts.project.wrap_kinds(facts) == {"dp"} and not any(f.distributed for f in facts.project.component(facts)):
        return  # one process (ddim's DataParallel script): the tensors go back where its model lives
    for call in facts.calls_to("torch.load"):
        source = arg(call, 0, "f")
        if source is not None and _is_buffer(facts, source):
            continue  # bytes another rank serialised (broadcast_object): no checkpoint file
        if source is not None and (mentions(source, is_rank_word) or per_rank_variable(facts, source, call)):
            continue  # this rank's own shard (`..._rank_{rank}.pt`), saved from its own device
        if source is not None and any(
            isinstance(n, ast.Constant) and "scheduler" in str(n.value).lower() for n in ast.walk(source)
        ):
            continue  # an LR scheduler's state (scheduler.pt): numbers, no tensor to place
        if arg(call, 1, "map_location") is None and not has_star_kwargs(call):
            yield finding(
                facts,
                call,
                "load-without-map-location",
                "torch.load without map_location restores tensors onto the device they "
                "were saved from (cuda:0 for every rank).",
                'pass map_location="cpu" (or the rank\'s own device).',
            )


@rule(
    "load-without-weights-only",
    ("P-CKPT-5",),
    WARNING,
    "torch.load without weights_only=True",
    """torch.load unpickles arbitrary Python objects unless weights_only=True: loading
      an untrusted checkpoint can run code. Be explicit with weights_only=True and keep
      checkpoints to tensors, numbers, strings and containers of them.""",
)
def load_without_weights_only(facts: Facts):
    for call in facts.calls_to("torch.load"):
        value = kwarg(call, "weights_only")
        if has_star_kwargs(call) or is_const(value, True):
            continue
        if value is not None:
            msg = (
                "torch.load with weights_only=False unpickles arbitrary objects: an untrusted checkpoint can run code."
            )
        else:
            msg = (
                "torch.load without weights_only: before torch 2.6 (the default then) it unpickles "
                "arbitrary objects, so an untrusted checkpoint can run code; from 2.6 the default "
                "is True and a checkpoint that holds other objects (an argparse Namespace, NumPy "
                "scalars) stops loading."
            )
        yield finding(
            facts,
            call,
            "load-without-weights-only",
            msg,
            "pass weights_only=True and keep the checkpoint to tensors and plain containers.",
            severity=WARNING,
        )
