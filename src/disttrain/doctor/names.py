"""Names the data-flow core and the rules share: references, callees, collectives,
launchers, device binds, rank-aware logging. No other doctor module is imported here, so
every module can import this one (the import graph stays a tree).
"""

from __future__ import annotations

import ast

GLOBAL, LOCAL, SOLO = "global", "local", "solo"

EXTERNAL = {
    "torch",
    "numpy",
    "np",
    "os",
    "sys",
    "math",
    "logging",
    "random",
    "time",
    "json",
    "shutil",
    "datetime",
    "accelerate",
    "transformers",
    "wandb",
    "tqdm",
    "argparse",
    "pathlib",
    "copy",
    "functools",
    "itertools",
    "collections",
    "re",
    "subprocess",
    "torchvision",
    "timm",
    "PIL",
    "yaml",
    "pickle",
    "io",
    "builtins",
    "warnings",
    "lightning",
    "pytorch_lightning",
    "deepspeed",
    "datasets",
    "einops",
    "tensorboard",
    "typing",
    "glob",
    "socket",
    "signal",
    "traceback",
    "contextlib",
    "inspect",
    "string",
}

SPAWNERS = (
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
    "multiprocessing.spawn",
    "torch.distributed.launcher.api.elastic_launch",
    "torch.distributed.elastic.multiprocessing.start_processes",
)

# Libraries' launchers: like mp.spawn they start the workers, so the code around the call
# runs once, in the launcher's parent (Detic's `detectron2.engine.launch(main, ...)`). The
# function they are handed takes no process index (detectron2 passes `args`).
LIBRARY_LAUNCHERS = (
    "detectron2.engine.launch",
    "detectron2.engine.launch.launch",
    "detectron2.engine.defaults.launch",
    "accelerate.notebook_launcher",
    "accelerate.launchers.notebook_launcher",
)

FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)

# torch.distributed functions every rank of the group must call.
TORCH_COLLECTIVES = {
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "new_group",
}
DCP = {"save", "load", "async_save", "save_state_dict", "load_state_dict"}
# DCP's state-dict helpers gather (full_state_dict) or at least talk to every rank.
DCP_STATE = {
    "get_model_state_dict",
    "get_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_state_dict",
    "set_optimizer_state_dict",
}
WRAPPER_COLLECTIVES = {
    "accelerator": {"wait_for_everyone", "gather", "gather_for_metrics", "reduce", "pad_across_processes"},
    "fabric": {"barrier", "all_reduce", "all_gather", "broadcast"},
    "strategy": {"barrier", "all_reduce", "all_gather", "broadcast"},
    "trainer": {"save_checkpoint"},
}
# mpi4py-style communicators (guided-diffusion's dist_util: MPI.COMM_WORLD.bcast).
MPI_COLLECTIVES = {
    "bcast",
    "Bcast",
    "allreduce",
    "Allreduce",
    "allgather",
    "Allgather",
    "Barrier",
    "barrier",
    "gather",
    "scatter",
    "reduce",
    "Reduce",
}


def ref(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = ref(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def refs_in(node: ast.AST) -> set[str]:
    """The dotted references (`loss`, `args.rank`) read anywhere inside `node`."""
    return {r for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute)) and (r := ref(n))}


def word(n: ast.AST) -> str | None:
    return n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None


def callee_name(facts, call: ast.Call) -> str | None:
    """The project-function name a call may reach: `f()`, `self.f()`, `utils.f()`; None for
    a call into a known library (`torch.save`, `np.load`)."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        head = call.func.value
        while isinstance(head, ast.Attribute):
            head = head.value
        if isinstance(head, ast.Name):
            root = facts.aliases.get(head.id, "").split(".")[0]
            if head.id in EXTERNAL or root in EXTERNAL:
                return None
        return call.func.attr
    return None


def is_spawn(facts, call: ast.Call) -> bool:
    q = facts.qualname(call.func) or ""
    if any(
        q == s or q.endswith("." + s.rsplit(".", 1)[-1]) and q.startswith(("torch.", "mp.", "multiprocessing."))
        for s in SPAWNERS
    ):
        return True
    return q in ("torch.multiprocessing.Process", "multiprocessing.Process")


def is_launcher(facts, call: ast.Call) -> bool:
    """A call that starts worker processes: a spawn, or a library's launcher."""
    return is_spawn(facts, call) or (facts.qualname(call.func) or "") in LIBRARY_LAUNCHERS


def collective_name(facts, call: ast.Call, fsdp1_targets: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The short name of a collective call, or None."""
    q = facts.qualname(call.func) or ""
    parts = q.split(".")
    if q.startswith("torch.distributed.checkpoint.") and parts[-1] in DCP:
        return f"dcp.{parts[-1]}"
    if q.startswith("torch.distributed.") and parts[-1] in DCP_STATE:
        return parts[-1]
    if q.startswith("torch.distributed.") and parts[-1] in TORCH_COLLECTIVES and "checkpoint" not in parts:
        return parts[-1]
    if isinstance(call.func, ast.Attribute):
        owner_ref = ref(call.func.value) or ""
        owner = owner_ref.split(".")[-1].lower()
        for w, names in WRAPPER_COLLECTIVES.items():
            if w in owner and call.func.attr in names:
                if w == "trainer" and lightning_before_2(facts):
                    return None  # save_checkpoint's barrier came with Lightning 2.1
                return call.func.attr
        if call.func.attr in MPI_COLLECTIVES and ("comm" in owner or "mpi" in owner_ref.lower()):
            return f"MPI {call.func.attr}"
        if call.func.attr == "state_dict" and owner_ref in fsdp1_targets and not call.args:
            return "FSDP state_dict"
    return None


# What Lightning removed in 2.0: a script that uses it runs on a Lightning before 2.0,
# whose Trainer.save_checkpoint writes on global zero and ends in no barrier.
_LIGHTNING_BEFORE_2 = {
    "from_argparse_args",
    "add_argparse_args",
    "on_pretrain_routine_start",
    "on_pretrain_routine_end",
    "on_keyboard_interrupt",
    "TestTubeLogger",
}


def lightning_before_2(facts) -> bool:
    """The script uses Lightning APIs removed in 2.0 (`Trainer.from_argparse_args`, the
    `on_pretrain_routine_start` hook, `accelerator="ddp"`)."""
    cache = facts.__dict__.setdefault("_lightning_before_2", [])
    if not cache:
        cache.append(
            any(
                (word(n) or getattr(n, "name", None)) in _LIGHTNING_BEFORE_2
                or (
                    isinstance(n, ast.keyword)
                    and n.arg == "accelerator"
                    and isinstance(n.value, ast.Constant)
                    and n.value.value in ("ddp", "ddp_spawn", "dp", "ddp2")
                )
                for n in facts.nodes
            )
        )
    return cache[0]


def kwarg_value(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def mentions(node: ast.AST, pred) -> bool:
    for n in ast.walk(node):
        w = word(n)
        if w and pred(w):
            return True
    return False


# disttrain's own entry points: they start the group (with a timeout), bind the device
# and wrap the model, so a script built on them is distributed and set up right.
DISTTRAIN_INITS = ("disttrain.init", "disttrain.distributed", "disttrain.runtime.init", "disttrain.runtime.distributed")

SET_DEVICE = (
    "torch.cuda.set_device",
    "torch.accelerator.set_device_index",
    "torch.cuda.device",
    "init_device_mesh",
)  # a CUDA mesh binds cuda:LOCAL_RANK itself
# Objects whose construction binds each process's GPU (Accelerate's state calls
# torch.cuda.set_device(local_rank) when it sets up a multi-GPU run; dora's distrib.init
# binds the local rank's device before it starts the process group).
LIBRARY_DEVICE_BINDS = (
    "accelerate.Accelerator",
    "accelerate.accelerator.Accelerator",
    "accelerate.PartialState",
    "accelerate.state.PartialState",
    "dora.distrib.init",
)


def takes_node_rank(facts) -> bool:
    """The launcher is told its node: a node rank, a machine rank, or a global rank
    computed from one (`args.rank * ngpus_per_node + gpu`). Once per file."""
    cache = facts.__dict__
    if "_node_rank" not in cache:
        cache["_node_rank"] = _takes_node_rank(facts)
    return cache["_node_rank"]


def _takes_node_rank(facts) -> bool:
    words = ("node_rank", "node-rank", "machine_rank", "nr", "node_id", "nodeid")
    if any(w in x.lower() for x in facts.strings for w in ("node_rank", "node-rank", "machine_rank")):
        return True
    for n in facts.nodes:
        w = word(n)
        if w and w.lower() in words:
            return True
        if (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Mult)
            and "rank" in ast.unparse(n.left).lower()
            and "per_node" in ast.unparse(n.right).lower()
        ):
            return True
    return False


def is_rank_word(w: str) -> bool:
    return "rank" in w.lower()


def rank_aware_logging(facts) -> bool:
    """The file filters or formats its logs by rank: a logging filter, a rank in a format
    string, a level chosen by the rank, or a handler/level set up on the main process only."""
    if facts.method_calls("addFilter") or any(
        (facts.qualname(b) or "").endswith("logging.Filter")
        for n in facts.nodes
        if isinstance(n, ast.ClassDef)
        for b in n.bases
    ):
        return True
    for call, q in facts.calls:
        last = q.rsplit(".", 1)[-1]
        # any Formatter (colorlog's ColoredFormatter too) whose format names the rank
        if last.endswith("Formatter") or last in ("basicConfig", "setLevel", "disable", "addHandler"):
            if any(
                mentions(a, is_rank_word)
                or any(
                    isinstance(c, ast.Constant) and isinstance(c.value, str) and "rank" in c.value.lower()
                    for c in ast.walk(a)
                )
                for a in list(call.args) + [k.value for k in call.keywords]
            ):
                return True
            if last in ("setLevel", "disable", "addHandler", "basicConfig") and facts.is_rank_guarded(call):
                return True
    return False
