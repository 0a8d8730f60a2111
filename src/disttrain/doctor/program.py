"""What one program (the files connected by imports) shows about printing, logging,
wraps, collectives, device binds, save wrappers and seeds: the part of the data-flow core
(dataflow.Project) that the rules ask about I/O and collectives.
"""

from __future__ import annotations

import ast
import re
from functools import cached_property
from typing import TYPE_CHECKING

from disttrain.doctor.names import (
    DISTTRAIN_INITS,
    EXTERNAL,
    FUNCTION_NODES,
    LIBRARY_DEVICE_BINDS,
    SET_DEVICE,
    collective_name,
    is_const,
    kwarg_value,
    rank_aware_logging,
    ref,
    word,
)
from disttrain.doctor.rank_names import LOCAL_RANK_ENV

if TYPE_CHECKING:
    from disttrain.doctor.facts import Facts, FuncDef, Wrap

# (facts, call, collective name, unconditional): where a function reaches a collective
Reach = tuple["Facts", ast.Call, str, bool]


class ProgramFacts:
    """Mixin of dataflow.Project: needs `files`, `defs`, `component()` and `resolve()`."""

    if TYPE_CHECKING:  # what dataflow.Project provides
        files: list[Facts]

        @property
        def defs(self) -> dict[str, list[tuple[Facts, FuncDef]]]: ...

        def component(self, facts: Facts) -> list[Facts]: ...

        def resolve(self, facts: Facts, call: ast.Call) -> list[tuple[Facts, FuncDef]]: ...

    def print_override_for(self, facts: Facts) -> tuple[Facts, ast.AST] | None:
        """Where `builtins.print` is replaced in the program `facts` belongs to."""
        comp = {id(f) for f in self.component(facts)}
        hits = [h for h in self.print_overrides if id(h[0]) in comp]
        return hits[0] if hits else None

    @cached_property
    def print_overrides(self) -> list[tuple[Facts, ast.AST]]:
        """Where `builtins.print` (or `__builtin__.print`) is replaced."""
        out: list[tuple[Facts, ast.AST]] = []
        for f in self.files:
            for n in f.nodes:
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and t.attr == "print"
                            and (f.qualname(t.value) or "") in ("builtins", "__builtin__", "__builtins__")
                        ):
                            out.append((f, n))
                        if (
                            isinstance(t, ast.Subscript)
                            and isinstance(t.slice, ast.Constant)
                            and t.slice.value == "print"
                            and "builtin" in ast.unparse(t.value)
                        ):
                            out.append((f, n))
                if (
                    isinstance(n, ast.Call)
                    and word(n.func) == "setattr"
                    and len(n.args) >= 2
                    and isinstance(n.args[1], ast.Constant)
                    and n.args[1].value == "print"
                    and "builtin" in ast.unparse(n.args[0])
                ):
                    out.append((f, n))
        return out

    def distributed_set_up_out_of_view(self, facts: Facts) -> str | None:
        """A call into project code out of view that initialises distribution
        (`utils.init_distributed_mode(args)`, `arg_util.init_dist_and_get_args()`,
        `setup_for_distributed(is_master)`): in the DeiT/MAE family that helper also
        replaces `builtins.print` with a main-process-only one. Libraries' inits and
        methods of objects (`deepspeed.init_distributed`, `self.backend.init_distributed`)
        are not it."""
        for f in self.component(facts):
            for _, q in f.calls:
                last = q.rsplit(".", 1)[-1]
                if q.split(".")[0] in EXTERNAL or q.startswith("self.") or last in self.defs:
                    continue
                words = _words(last)
                if last == "setup_for_distributed" or ("init" in words and any(w.startswith("dist") for w in words)):
                    return q
        return None

    def rank_aware_logging(self, facts: Facts) -> bool:
        return any(rank_aware_logging(f) for f in self.component(facts))

    def logging_set_up_out_of_view(self, facts: Facts) -> str | None:
        """A logger set-up call into code out of view that is told the rank
        (`setup_logger(output, distributed_rank=rank)`), or a library logger made
        main-process-only (`accelerate.logging.get_logger`)."""
        for f in self.component(facts):
            for c, q in f.calls:
                last = q.rsplit(".", 1)[-1].lower()
                if q.startswith("accelerate.logging.get_logger") or q.endswith("accelerate.logging.get_logger"):
                    return q
                if (
                    last
                    in (
                        "setup_logger",
                        "setup_logging",
                        "init_logger",
                        "init_logging",
                        "configure_logging",
                        "setup_default_logging",
                        "set_up_logging",
                    )
                    and last not in self.defs
                ):
                    return q  # logging configured by code out of view: not judged here
                if (
                    "log" in last
                    and any(w in last for w in ("setup", "set_up", "init", "config", "create"))
                    and last not in self.defs
                    and (
                        any(k.arg and "rank" in k.arg.lower() for k in c.keywords)
                        or any(
                            "rank" in (word(n) or "").lower()
                            or "main" in (word(n) or "").lower()
                            or "master" in (word(n) or "").lower()
                            for a in list(c.args) + [k.value for k in c.keywords]
                            for n in ast.walk(a)
                        )
                    )
                ):
                    return q
        return None

    @cached_property
    def referenced_names(self) -> set[str]:
        """Every name read (`f`, `obj.f`) in the files of the run: a function whose name is
        not among them is called from nowhere the doctor sees."""
        return {
            n.id if isinstance(n, ast.Name) else n.attr
            for f in self.files
            for n in f.nodes
            if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)) or isinstance(n, ast.Attribute)
        }

    # ----- wraps, collectives, devices ----------------------------------------------

    @cached_property
    def wraps(self) -> list[tuple[Facts, Wrap]]:
        return [(f, w) for f in self.files for w in f.wraps]

    def wrap_kinds(self, facts: Facts) -> set[str]:
        """The wrapper kinds of the program `facts` belongs to."""
        return {w.kind for f in self.component(facts) for w in f.wraps}

    def fsdp1_targets(self, facts: Facts) -> set[str]:
        """Names bound to an FSDP1 wrap in the program `facts` belongs to."""
        return {t for f in self.component(facts) for w in f.wraps if w.kind == "fsdp1" for t in (w.target, w.arg) if t}

    @cached_property
    def ddp_targets(self) -> dict[str, Wrap]:
        """Names bound to a DDP wrap that broadcasts buffers in forward (the default)."""
        return {
            w.target: w
            for _, w in self.wraps
            if w.kind == "ddp" and w.target and not is_const(kwarg_value(w.call, "broadcast_buffers"), False)
        }

    @cached_property
    def collective_functions(self) -> dict[ast.AST, Reach]:
        """definition -> (facts, call, collective name, unconditional) for each project
        function that reaches a collective: directly, or through another project function.
        The flag says whether that collective runs on every call (no `if` around it, nor
        around the one a called function reaches)."""
        out: dict[ast.AST, Reach] = {}
        changed = True
        while changed:
            changed = False
            for ds in self.defs.values():
                for f, d in ds:
                    if d in out and out[d][3]:
                        continue
                    hit = self._first_collective(f, d, out)
                    if hit and (d not in out or hit[3]):  # new, or now found on every call
                        changed = changed or d not in out or hit[3] != out[d][3]
                        out[d] = hit
        return out

    def reached_collective(self, facts: Facts, call: ast.Call) -> Reach | None:
        """(facts, call, name, unconditional) of the collective a call to a project
        function reaches, or None."""
        hits = [self.collective_functions[d] for _, d in self.resolve(facts, call) if d in self.collective_functions]
        return hits[0] if hits else None

    def call_collective_name(self, f: Facts, call: ast.Call) -> str | None:
        key = id(call)
        cache = self._names
        if key not in cache:
            name = collective_name(f, call, self.fsdp1_targets(f))
            if name == "FSDP state_dict" and off_mode(f, call, self.fsdp_mode_flags(f)):
                name = None  # `cpu_state if args.fsdp else model.state_dict()`: the DDP path
            cache[key] = name
        return cache[key]

    def fsdp_mode_flags(self, facts: Facts) -> set[str]:
        """The flags every FSDP1 wrap of the program sits under (`if args.fsdp: model =
        FSDP(model)`): FSDP is then a mode, off where the flag is false. Empty when some
        wrap is unconditional."""
        flags: set[str] | None = None
        for f in self.component(facts):
            for w in f.wraps:
                if w.kind != "fsdp1":
                    continue
                here: set[str] = set()
                child: ast.AST = w.call
                for a in f.ancestors(w.call):
                    flag = ref(a.test) if isinstance(a, ast.If) and child in a.body else None
                    if flag:
                        here.add(flag)
                    if isinstance(a, FUNCTION_NODES):
                        break
                    child = a
                flags = here if flags is None else flags & here
        return flags or set()

    @cached_property
    def _names(self) -> dict:
        return {}

    def _first_collective(self, f: Facts, d: ast.AST, known: dict[ast.AST, Reach]) -> Reach | None:
        best: Reach | None = None
        for n in f.scoped.get(d, ()):
            if not isinstance(n, ast.Call):
                continue
            name, inner = self.call_collective_name(f, n), True
            if name is None:
                for _, callee in self.resolve(f, n):
                    if callee in known and callee is not d:
                        name = f"{known[callee][2].split(' (in ')[0]} (in {callee.name}())"
                        inner = known[callee][3]  # a collective under a condition in the callee
                        break
            if name:
                unconditional = inner and not any(
                    isinstance(a, (ast.If, ast.IfExp, ast.Try, ast.BoolOp)) for a in _ancestors_until(f, n, d)
                )
                cand = (f, n, name, unconditional)
                if best is None or (unconditional and not best[3]):
                    best = cand
        return best

    def binds_device(self, facts: Facts) -> list[tuple[Facts, ast.Call]]:
        """set_device calls (and the library objects that make one) in the program `facts`
        belongs to."""
        return [
            (f, c)
            for f in self.component(facts)
            for c in f.calls_to(*SET_DEVICE, *DISTTRAIN_INITS, *LIBRARY_DEVICE_BINDS)
        ]

    def no_sync_used(self, facts: Facts) -> bool:
        return any(
            isinstance(n, ast.Attribute)
            and n.attr in ("no_sync", "require_backward_grad_sync", "set_requires_gradient_sync")
            for f in self.component(facts)
            for n in f.nodes
        )

    @cached_property
    def save_wrappers(self) -> dict[str, int]:
        """Project functions that hand their arguments to torch.save: `def
        save_on_master(*args, **kwargs): torch.save(*args, **kwargs)` -> the index of the
        path among the call's arguments (1 for `save_on_master(obj, path)`)."""
        out: dict[str, int] = {}
        for name, ds in self.defs.items():
            for f, d in ds:
                params = [a.arg for a in d.args.args if a.arg not in ("self", "cls")]
                for c in f.calls_to("torch.save"):
                    if f.scope_of(c) is not d:
                        continue
                    # (a wrapper that names its path parameter is judged at its own torch.save)
                    if any(isinstance(a, ast.Starred) for a in c.args) and d.args.vararg:
                        out[name] = len(params) + 1
        return out

    @cached_property
    def reads_local_rank_env(self) -> bool:
        """Some file reads a local rank a launcher sets: torchrun's LOCAL_RANK, SLURM's,
        MPI's or Horovod's (`hvd.local_rank()`)."""
        return any(
            f.strings & set(LOCAL_RANK_ENV) or any(q.endswith(".local_rank") for _, q in f.calls) for f in self.files
        )

    @cached_property
    def rank_seeded(self) -> ast.Call | None:
        """A global seed that differs per rank: `torch.manual_seed(args.seed + rank)`."""
        for f in self.files:
            for c in f.calls_to(
                "torch.manual_seed",
                "torch.random.manual_seed",
                "random_seed",
                "set_seed",
                "seed_everything",
                "init_seeds",
                "fix_random_seeds",
            ):
                for a in c.args:
                    if _mentions_rank(f, a):
                        return c
                    r = ref(a)
                    if r:
                        for n in f.nodes:
                            if (
                                isinstance(n, ast.Assign)
                                and any(ref(t) == r for t in n.targets)
                                and _mentions_rank(f, n.value)
                            ):
                                return c
        return None


def _mentions_rank(f, node: ast.AST) -> bool:
    vs = f.rank_variables
    for n in ast.walk(node):
        r = ref(n)
        w = word(n)
        if (
            (r and r in vs)
            or (w and ("rank" in w.lower()))
            or (isinstance(n, ast.Call) and word(n.func) in ("get_rank", "get_global_rank"))
        ):
            return True
    return False


def _ancestors_until(f, node: ast.AST, stop: ast.AST):
    for a in f.ancestors(node):
        if a is stop:
            return
        yield a


def _words(name: str) -> list[str]:
    """`init_dist_and_get_args` -> init, dist, and, get, args; `initDistMode` -> init, dist, mode."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]


def off_mode(f, node: ast.AST, flags: set[str]) -> bool:
    """`node` runs only where one of `flags` is false: the else of `if flag` (or of
    `x if flag else y`), the body of `if not flag`, or after `assert not flag` in its block."""
    if not flags:
        return False
    child = node
    for a in f.ancestors(node):
        if isinstance(a, (ast.If, ast.IfExp)) and child is not a.test:
            t = a.test
            in_else = child in a.orelse if isinstance(a, ast.If) else child is a.orelse
            negated = isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and ref(t.operand) in flags
            if (ref(t) in flags and in_else) or (negated and not in_else):
                return True
        for block in (getattr(a, "body", None), getattr(a, "orelse", None)):
            if (
                isinstance(block, list)
                and child in block
                and any(
                    isinstance(s, ast.Assert)
                    and isinstance(s.test, ast.UnaryOp)
                    and isinstance(s.test.op, ast.Not)
                    and ref(s.test.operand) in flags
                    for s in block[: block.index(child)]
                )
            ):
                return True
        if isinstance(a, FUNCTION_NODES):
            break
        child = a
    return False
