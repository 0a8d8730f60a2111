"""The project's data flow: what the rules ask instead of matching patterns.

One `Project` is shared by every file of a run (`analyze_paths` builds it; a file
checked alone gets a project of one). It answers, across the files:

* **rank-derived values** (`rank_values`): names and attributes read from the rank
  (`RANK`, `dist.get_rank()`, `LOCAL_RANK`), flags computed from them
  (`args.save_logs = args.logs and is_master(args)`, `is_main = rank == 0`), functions
  that return such a flag (`def is_master(args): return args.rank == 0`), and objects
  created only under a rank guard (`writer = SummaryWriter() if rank == 0 else None`,
  `if rank == 0: tb = SummaryWriter(...)`), whose tests (`if writer is not None`) are
  rank guards too. Attributes (`args.rank`) are shared between files, plain names stay
  in their file.
* **functions that run on one rank only** (`guarded`): named or decorated rank-zero,
  or every call site (in any file of the run) guarded; a function handed to a launcher
  (`mp.spawn(worker, ...)`) is an entry point and never guarded.
* **rank-aware printing and logging**: `builtins.print` replaced (`setup_for_distributed`),
  a `print` of the file's own, a logging filter, a level or handler set by rank, or a
  logger set up by a function out of view (`setup_logger(output, distributed_rank=rank)`).
* **collectives**: torch.distributed and its wrappers' collectives, MPI-style ones
  (`comm.bcast`), DCP's state-dict helpers, an FSDP1 module's `state_dict()`, and every
  function of the project that reaches one (`collective_functions`), with the path.
* **device binding and wraps across files** (`binds_device`, `wraps`).

Contract: read-only over the files' trees; every answer is computed once, lazily.
"""

from __future__ import annotations

import ast
from functools import cached_property
from typing import TYPE_CHECKING

from disttrain.doctor import control_flow, rank_values
from disttrain.doctor.names import (  # noqa: F401  (re-exported for the rules)
    EXTERNAL,
    FUNCTION_NODES,
    GLOBAL,
    LOCAL,
    SOLO,
    callee_name,
    collective_name,
    is_launcher,
    is_spawn,
    kwarg_value,
    ref,
    word,
)
from disttrain.doctor.program import ProgramFacts
from disttrain.doctor.receivers import receiver_classes

if TYPE_CHECKING:
    from disttrain.doctor.facts import Facts, FuncDef


class Project(ProgramFacts):
    """The files of one run, and what holds across them."""

    def __init__(self, files: list[Facts]):
        self.files = files

    # ----- definitions and call sites -------------------------------------------------

    @cached_property
    def defs(self) -> dict[str, list[tuple[Facts, FuncDef]]]:
        out: dict = {}
        for f in self.files:
            for name, ds in f.functions.items():
                out.setdefault(name, []).extend((f, d) for d in ds)
        return out

    @cached_property
    def classes(self) -> dict[str, list[tuple[Facts, ast.ClassDef]]]:
        out: dict = {}
        for f in self.files:
            for n in f.nodes:
                if isinstance(n, ast.ClassDef):
                    out.setdefault(n.name, []).append((f, n))
        return out

    @cached_property
    def spawner_defs(self) -> set[ast.AST]:
        """Functions that start worker processes, directly or through a project function
        (detectron2's `launch()` calls mp.start_processes)."""
        out: set[ast.AST] = set()
        for f in self.files:
            for c, _ in f.calls:
                if is_launcher(f, c):
                    s = f.scope_of(c)
                    if isinstance(s, FUNCTION_NODES):
                        out.add(s)
        return out

    @cached_property
    def imports(self) -> dict[int, set[int]]:
        """id(file) -> ids of the other files of the run it imports (by module name:
        `import util.misc as misc`, `from engine import train_one_epoch`, `from . import utils`)."""
        from pathlib import PurePath

        by_stem: dict[str, list] = {}
        for f in self.files:
            p = PurePath(f.path)
            stem = p.parent.name if p.stem == "__init__" else p.stem
            by_stem.setdefault(stem, []).append(f)
        out: dict[int, set[int]] = {}
        for f in self.files:
            mods: set[str] = set()
            packages: set[str] = set()
            for n in f.nodes:
                if isinstance(n, ast.Import):
                    for a in n.names:
                        mods |= set(a.name.split("."))
                        packages.add(a.name)
                elif isinstance(n, ast.ImportFrom):
                    if n.module:
                        mods |= set(n.module.split("."))
                        packages.add(n.module)
                    mods |= {a.name for a in n.names}  # `from pkg import module`
            found = {id(g) for m in mods for g in by_stem.get(m, []) if g is not f}
            out[id(f)] = found | {id(g) for g in self._package_files(packages) if g is not f}
        return out

    def _package_files(self, packages: set[str]) -> list:
        """The files directly inside an imported package whose `__init__` is not among the
        files checked (`import fourm.utils as utils` with fourm/utils/dist.py here): the
        missing `__init__` re-exports them, as far as the doctor can tell. Matched on the
        whole dotted path (`fourm/utils`), so `import torch.utils.data` links nothing."""
        from pathlib import PurePath

        inits = {PurePath(f.path).parent.as_posix() for f in self.files if PurePath(f.path).stem == "__init__"}
        out = []
        for f in self.files:
            folder = PurePath(f.path).parent.as_posix()
            if folder in inits:
                continue
            if any(
                folder == p.replace(".", "/") or folder.endswith("/" + p.replace(".", "/"))
                for p in packages
                if "." in p
            ):
                out.append(f)
        return out

    def imported_names(self, facts) -> set[str]:
        """Names an import statement binds in the file (relative imports included)."""
        key = ("names", id(facts))
        if key not in self._components:
            out = set()
            for n in facts.nodes:
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    out |= {(a.asname or a.name).split(".")[0] for a in n.names}
            self._components[key] = out
        return self._components[key]

    def component(self, facts: Facts) -> list[Facts]:
        """The files connected to `facts` by imports (either way): one program. Unrelated
        scripts checked in one run do not lend each other a set_device or a print override."""
        key = id(facts)
        if key not in self._components:
            self._components[key] = self._component(facts)
        return self._components[key]

    @cached_property
    def _components(self) -> dict:
        return {}

    def _component(self, facts) -> list:
        links: dict[int, set[int]] = {id(f): set() for f in self.files}
        for a, bs in self.imports.items():
            for b in bs:
                links[a].add(b)
                links[b].add(a)
        seen, todo = {id(facts)}, [id(facts)]
        while todo:
            for b in links.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return [f for f in self.files if id(f) in seen]

    def resolve(self, facts: Facts, call: ast.Call) -> list[tuple[Facts, FuncDef]]:
        """The project definitions a call may reach. `f()`: a function of the caller's own
        file, else one of the files it imports; `module.f()` (an imported module): a
        module-level function of an imported file; `self.f()` / `obj.f()`: a method (a def
        inside a class) of the caller's file, else of an imported file. A module-level
        function is never reached through an object's attribute (`callbacks.run()` is
        not train.py's `def run()`), nor the method a call sits in through another object
        (`self.ema.update()` in `def update(self)` delegates)."""
        name = callee_name(facts, call)
        if name and name in self.classes:  # `TensorboardLogger(...)` runs its __init__
            inits = [
                (f, d)
                for f, c in self.classes[name]
                for d in c.body
                if isinstance(d, FUNCTION_NODES) and d.name == "__init__"
            ]
            own = [(f, d) for f, d in inits if f is facts]
            imported = self.imports.get(id(facts), set())
            return own or [(f, d) for f, d in inits if id(f) in imported]
        if not name or name not in self.defs:
            return []
        cands = self.defs[name]
        func = call.func
        if isinstance(func, ast.Attribute):
            head = func.value
            is_module = isinstance(head, ast.Name) and head.id in self.imported_names(facts)
            if is_module:
                imported = self.imports.get(id(facts), set())
                return [(f, d) for f, d in cands if id(f) in imported and _module_level(f, d)]
            # a method of the class the receiver is, never one that only shares its name
            # (`tokenizer.save_pretrained()` is not the trainer's own save_pretrained)
            owners = receiver_classes(self.classes, facts, call)
            cands = [(f, d) for f, d in cands if _is_method(f, d) and getattr(f.parents[d], "name", "") in owners]
        own = [(f, d) for f, d in cands if f is facts]
        if own:
            return own
        imported = self.imports.get(id(facts), set())
        return [(f, d) for f, d in cands if id(f) in imported]

    @cached_property
    def call_sites(self) -> dict[ast.AST, list[tuple[Facts, ast.Call]]]:
        """definition -> every call in the run that may reach it."""
        out: dict = {}
        for f in self.files:
            for n in f.nodes:
                if isinstance(n, ast.Call):
                    for _, d in self.resolve(f, n):
                        out.setdefault(d, []).append((f, n))
        return out

    @cached_property
    def spawn_index_params(self) -> set[int]:
        """ids of the first parameter of functions handed to mp.spawn / start_processes:
        the process index, a local rank (`def main_worker(gpu, ngpus_per_node, args)`)."""
        out = set()
        for f in self.files:
            for c, q in f.calls:
                if is_spawn(f, c) and not q.endswith("Process"):
                    fn = c.args[0] if c.args else kwarg_value(c, "fn")
                    w = word(fn) if fn is not None else None
                    for d in f.functions.get(w, []) if w else []:  # the target in the same file
                        if d.args.args:
                            out.add(id(d.args.args[0]))
        return out

    @cached_property
    def entry_points(self) -> set[str]:
        """Functions handed to a launcher: `mp.spawn(main_worker, ...)`, Process(target=f)."""
        out = set()
        for f in self.files:
            for c, _ in f.calls:
                if is_launcher(f, c):
                    for a in list(c.args[:1]) + [
                        k.value for k in c.keywords if k.arg in ("fn", "target", "entrypoint")
                    ]:
                        w = word(a)
                        if w:
                            out.add(w)
        return out

    # ----- rank-derived values ------------------------------------------------------

    @cached_property
    def rank_flag_functions(self) -> dict[str, str]:
        """Functions that return a rank or a flag computed from it: `def is_master(args):
        return args.rank == 0`, `def get_rank(): return dist.get_rank()`."""
        out: dict[str, str] = {}
        for _ in range(3):
            for name, ds in self.defs.items():
                if name in out:
                    continue
                for f, d in ds:
                    for n in f.scoped.get(d, ()):
                        if isinstance(n, ast.Return) and n.value is not None:
                            k = rank_values.value_rank_kind(f, n.value, {}, out)
                            if k:
                                out[name] = k
                                break
                    if name in out:
                        break
        return out

    @cached_property
    def shared_rank_values(self) -> dict[str, str]:
        """Attribute refs (`args.rank`, `args.save_logs`, `self.is_main`) that hold a rank
        or a rank flag in any file: shared by every file of the run."""
        out: dict[str, str] = {}
        for f in self.files:
            for k, v in f.own_rank_values.items():
                if "." in k:
                    out.setdefault(k, v)
        return out

    # ----- one-rank functions -------------------------------------------------------

    @cached_property
    def guarded(self) -> dict[ast.AST, str]:
        """Function definitions that run on one rank (or one per node, or in the launcher's
        parent only) as far as every call site in the run shows."""
        guarded: dict[ast.AST, str] = {}
        for _name, ds in self.defs.items():
            for _f, d in ds:
                if control_flow.zero_only_function(d):
                    guarded[d] = GLOBAL
        for f in self.files:
            f.__dict__["guarded_functions"] = guarded  # visible to rank_guard below
        changed = True
        while changed:
            changed = False
            for fn, sites in self.call_sites.items():
                if not isinstance(fn, FUNCTION_NODES) or fn.name in self.entry_points:  # (keys are all defs)
                    continue
                kinds = [control_flow.rank_guard(f, c) for f, c in sites]
                if not kinds or not all(kinds):
                    continue
                if complementary_sites(sites):
                    continue  # called from both branches of one rank test: every rank calls it
                kind = LOCAL if LOCAL in kinds else GLOBAL if GLOBAL in kinds else SOLO
                if guarded.get(fn) is None or (guarded[fn] != kind and guarded[fn] == SOLO):
                    guarded[fn] = kind
                    changed = True
        return guarded

    # ----- printing and logging -----------------------------------------------------


def complementary_sites(sites) -> bool:
    """Two call sites sit in opposite branches of the same `if` on the rank (sam2's
    `broadcast()` called under `if get_rank() == src:` and in its `else`)."""
    seen: dict[int, set[bool]] = {}
    for f, c in sites:
        child = c
        for a in f.ancestors(c):
            if isinstance(a, ast.If) and child is not a.test and control_flow.guard_kind(f, a.test):
                seen.setdefault(id(a), set()).add(child in a.body)
                break
            if isinstance(a, FUNCTION_NODES):
                break
            child = a
    return any(len(v) == 2 for v in seen.values())


def _is_method(f, d: ast.AST) -> bool:
    return isinstance(f.parents.get(d), ast.ClassDef)


def _module_level(f, d: ast.AST) -> bool:
    return f.parents.get(d) is f.tree
