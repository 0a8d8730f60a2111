"""What the rules know about one script: its AST, import aliases, calls, wraps, scopes.

Contract: `Facts.parse(path, source)` never executes the script; it raises `SyntaxError`
for a script that does not parse (the caller turns it into a `UserError`). Everything
else is derived lazily from the tree so that each rule asks only what it needs.
Names are resolved through the script's own imports, so `nn.DataParallel`,
`torch.nn.DataParallel` and `from torch.nn import DataParallel as DP` all read
`torch.nn.DataParallel`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from disttrain.doctor import control_flow, rank_values
from disttrain.doctor.names import DISTTRAIN_INITS  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from disttrain.doctor.dataflow import Project

DISTTRAIN_WRAPS = ("disttrain.wrap", "disttrain.parallel.wrap")

Scope = ast.AST  # a FunctionDef, AsyncFunctionDef, Lambda or the Module
FuncDef = ast.FunctionDef | ast.AsyncFunctionDef  # what `def` makes (Facts.functions)


@dataclass
class Wrap:
    """One parallel wrapper call: `target = KIND(arg, ...)` (target is None when inline).

    kind: "ddp", "fsdp1" (FullyShardedDataParallel), "fsdp2" (fully_shard, in place),
    "dp" (DataParallel) or "disttrain" (`disttrain.wrap`, any strategy). `arg`/`target` are
    dotted references such as `model` or `self.model`; None when the expression is not a
    plain reference.
    """

    kind: str
    call: ast.Call
    arg: str | None
    target: str | None
    scope: Scope


# What Facts learns from its file alone (cached properties and caches), kept by `fresh`.
_OWN_ANSWERS = frozenset(
    {"calls", "_method_calls", "strings", "scoped", "functions", "wraps", "distributed", "_calls_to", "_node_rank"}
)

# Packages with a `torch` submodule of their own: `safetensors.torch.load` reads
# tensors, unpickles nothing, and is no `torch.load`.
_FOREIGN_TORCH = ("safetensors.",)


def _foreign(q: str, name: str) -> bool:
    return q.startswith(_FOREIGN_TORCH) and not name.startswith(_FOREIGN_TORCH)


@dataclass
class Facts:
    path: str
    source: str
    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    nodes: list[ast.AST] = field(default_factory=list)  # every node, walked once
    # the other files of the same run (rules may follow a call into them)
    others: list[Facts] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def parse(cls, path: str, source: str) -> Facts:
        tree = ast.parse(source, filename=path)
        facts = cls(path=path, source=source, tree=tree)
        facts.nodes = list(ast.walk(tree))
        for node in facts.nodes:
            for child in ast.iter_child_nodes(node):
                facts.parents[child] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    # `import torch.distributed` binds `torch`; `... as dist` binds dist.
                    if a.asname:
                        facts.aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        facts.aliases[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    facts.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return facts

    def fresh(self) -> Facts:
        """The same parsed file with none of the answers that depend on the other files
        of its run (it keeps those of the file alone): to judge it again in another program."""
        copy = Facts(self.path, self.source, self.tree, self.aliases, self.parents, self.nodes)
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k in _OWN_ANSWERS})
        return copy

    # ----- names -------------------------------------------------------------------

    def qualname(self, node: ast.AST) -> str | None:
        """The dotted name of a Name/Attribute chain, its head resolved via imports."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    @cached_property
    def calls(self) -> list[tuple[ast.Call, str]]:
        """Every call whose callee is a dotted name, with that name resolved, in source order."""
        out = [(n, self.qualname(n.func)) for n in self.nodes if isinstance(n, ast.Call)]
        found = [(c, q) for c, q in out if q]
        found.sort(key=lambda cq: (cq[0].lineno, cq[0].col_offset))
        return found  # type: ignore[return-value]

    def calls_to(self, *names: str) -> list[ast.Call]:
        """Calls whose resolved name ends with one of `names` (whole dotted components).

        disttrain's own API (`disttrain.DistributedSampler`, ...) is the safe version of
        what the rules look for, so it matches only when a name starts with `disttrain`.
        A package's own `torch` module (`safetensors.torch.load`) is not torch.
        """
        cache = self.__dict__.setdefault("_calls_to", {})
        if names not in cache:
            cache[names] = [
                c
                for c, q in self.calls
                if any(
                    ends_with(q, n)
                    and (n.startswith("disttrain") or not q.startswith("disttrain."))
                    and not _foreign(q, n)
                    for n in names
                )
            ]
        return list(cache[names])

    def method_calls(self, attr: str) -> list[ast.Call]:
        """Calls of the form `<anything>.attr(...)`."""
        return self._method_calls.get(attr, [])

    @cached_property
    def _method_calls(self) -> dict[str, list[ast.Call]]:
        out: dict[str, list[ast.Call]] = {}
        for n in self.nodes:
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                out.setdefault(n.func.attr, []).append(n)
        return out

    @cached_property
    def strings(self) -> set[str]:
        return {n.value for n in self.nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    # ----- structure ---------------------------------------------------------------

    def scope_of(self, node: ast.AST) -> Scope:
        """The innermost function (or the module) that contains `node`."""
        cur = self.parents.get(node)
        while cur is not None:
            if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return cur
            cur = self.parents.get(cur)
        return self.tree

    def ancestors(self, node: ast.AST):
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def enclosing_loop(self, node: ast.AST) -> ast.AST | None:
        """The innermost for/while loop around `node` within its own function."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.For, ast.AsyncFor, ast.While)):
                return a
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return None
        return None

    @cached_property
    def scoped(self) -> dict[ast.AST, list[ast.AST]]:
        """Scope (function or module) -> the Call and Return nodes directly in it."""
        out: dict[ast.AST, list[ast.AST]] = {}
        for n in self.nodes:
            if isinstance(n, (ast.Call, ast.Return)):
                out.setdefault(self.scope_of(n), []).append(n)
        return out

    @cached_property
    def functions(self) -> dict[str, list[FuncDef]]:
        out: dict[str, list[FuncDef]] = {}
        for n in self.nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(n.name, []).append(n)
        return out

    # ----- distributed shape of the script -----------------------------------------

    @cached_property
    def wraps(self) -> list[Wrap]:
        kinds = {
            "DistributedDataParallel": "ddp",
            "FullyShardedDataParallel": "fsdp1",
            "fully_shard": "fsdp2",
            "DataParallel": "dp",
        }
        out = []
        for call, q in self.calls:
            kind = (
                "disttrain"
                if q in DISTTRAIN_WRAPS
                else (None if q.startswith("disttrain.") else kinds.get(q.rsplit(".", 1)[-1]))
            )
            if kind is None or not call.args:
                continue
            parent = self.parents.get(call)
            target = None
            if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
                target = ref(parent.targets[0])
            elif isinstance(parent, ast.AnnAssign):
                target = ref(parent.target)
            arg = base_ref(call.args[0])
            if kind == "fsdp2" and target is None:
                target = arg  # fully_shard works in place
            out.append(Wrap(kind, call, arg, target, self.scope_of(call)))
        return out

    @cached_property
    def distributed(self) -> bool:
        """True when the script runs as several ranks (torchrun env or a process group)."""
        if self.calls_to("init_process_group", "init_device_mesh", *DISTTRAIN_INITS):
            return True
        if any(w.kind != "dp" for w in self.wraps):
            return True
        if any(
            _multi_process_trainer(c)
            for c in self.calls_to("lightning.Trainer", "pytorch.Trainer", "pytorch_lightning.Trainer")
        ):
            return True  # Lightning runs the whole script once per device
        return bool({"LOCAL_RANK", "WORLD_SIZE", "RANK"} & self.strings)

    # ----- paths and rank guards (control_flow.py) ---------------------------------

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """`a` and `b` sit in different branches of one if/elif/else: never both run."""
        return control_flow.exclusive(self, a, b)

    def rank_guard(self, node: ast.AST, subset: bool = False, local: bool = False) -> str | None:
        """ "global", "local" (one process per node), "solo" (one process: the single-process
        branch, the launcher's parent) or None: see control_flow.rank_guard."""
        return control_flow.rank_guard(self, node, subset, local)

    def is_rank_guarded(self, node: ast.AST) -> bool:
        """True when `node` runs on one rank (or one per node) only, as far as the source shows."""
        return control_flow.rank_guard(self, node) is not None

    @cached_property
    def guarded_functions(self) -> dict[ast.AST, str]:
        return control_flow.guarded_functions(self)

    @cached_property
    def rank_variables(self) -> dict[str, str]:
        return rank_values.rank_variables(self)

    @cached_property
    def own_rank_values(self) -> dict[str, str]:
        return rank_values.own_rank_values(self)

    @cached_property
    def spawner_scopes(self) -> set:
        return control_flow.spawner_scopes(self)

    @cached_property
    def project(self) -> Project:
        """What holds across the files of the run (dataflow.Project); analyze_paths
        shares one between them, a file checked alone is a project of one."""
        from disttrain.doctor.dataflow import Project

        return Project([self, *self.others])

    # ----- the other files checked in the same run -----------------------------------

    def project_functions(self, name: str) -> list[tuple[Facts, FuncDef]]:
        """Definitions of `name` in this file and the other files given on the command line."""
        return [(f, d) for f in [self, *self.others] for d in f.functions.get(name, [])]


def _multi_process_trainer(call: ast.Call) -> bool:
    """A Lightning Trainer with a ddp/fsdp/deepspeed strategy or more than one device."""
    strategy = kwarg(call, "strategy")
    if (
        isinstance(strategy, ast.Constant)
        and isinstance(strategy.value, str)
        and any(w in strategy.value for w in ("ddp", "fsdp", "deepspeed"))
    ):
        return True
    devices = kwarg(call, "devices") or kwarg(call, "gpus")
    return isinstance(devices, ast.Constant) and isinstance(devices.value, int) and devices.value > 1


def ends_with(qualname: str, name: str) -> bool:
    """`torch.nn.parallel.DistributedDataParallel` ends with `DistributedDataParallel`
    but `DistributedDataParallel` does not end with `DataParallel` (whole components)."""
    return qualname == name or qualname.endswith("." + name)


def ref(node: ast.AST) -> str | None:
    """`model` or `self.model` for a Name/Attribute chain; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = ref(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def base_ref(node: ast.AST) -> str | None:
    """The object a method chain starts from: `model.to(dev).cuda()` -> `model`."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return ref(node)


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def has_star_kwargs(call: ast.Call) -> bool:
    return any(k.arg is None for k in call.keywords)


def arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """Positional argument `index`, or keyword `name`."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return kwarg(call, name)


def is_const(node: ast.AST | None, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def mentions(node: ast.AST, pred) -> bool:
    """True when some Name id / Attribute attr inside `node` satisfies `pred`."""
    for n in ast.walk(node):
        word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if word and pred(word):
            return True
    return False
