"""A run split into programs, one per entry point.

An entry point is a file with an `if __name__ == "__main__":` block, the module a console
script names (`[project.scripts]` in a pyproject.toml, `console_scripts` in a setup.py or
setup.cfg found among the folders checked), or a file that no other checked file imports
and that is named on the command line or runs code at module level (a script without a
`__main__` block). A program is its entry file plus every checked file it
imports, transitively (imports resolved by module path, as Python would find them from
the entry's folder or the folder that holds the package). Two scripts of one folder are
two programs: what one sets up (a wrap, a set_device, a scaler) is never lent to the
other. A module imported by several programs belongs to each of them.

Files that no entry point reaches are one more group, entry None: they are judged as
a run without entry points always was, with every file of the run in view (an entry
script may reach them through code that was not checked), and only their own findings
are kept (the reached files are judged in their programs).

Contract: `split(files, paths)` is pure over the parsed files and the config files in
the folders of `paths`; every file is reported in at least one group; groups are in the
order of their entry files (the unreached group last).
"""

from __future__ import annotations

import ast
import configparser
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disttrain.doctor.facts import Facts

Parts = tuple[str, ...]


@dataclass(frozen=True)
class Program:
    """`entry`: the entry file's path as checked (None for the files no entry reaches);
    `files`: indexes into the run's files, the entry first; `reported`: the files whose
    findings this group gives (all of `files` but for the unreached group)."""

    entry: str | None
    files: tuple[int, ...]
    reported: frozenset[int]


def split(files: list[Facts], paths: list[str]) -> list[Program]:
    """The programs of a run (see the module docstring)."""
    where = [_parts(f.path) for f in files]
    index = _ModuleIndex(where)
    imports = [index.imported_by(i, f) for i, f in enumerate(files)]
    imported = {j for js in imports for j in js}
    named = {_parts(p) for p in paths if os.path.isfile(p)}
    entries = [
        i
        for i, f in enumerate(files)
        if _has_main_block(f.tree) or (i not in imported and (where[i] in named or _runs_code(f.tree)))
    ]
    entries += [i for i in _console_targets(files, paths, index) if i not in entries]
    entries.sort()
    programs = []
    for i in entries:
        members = _closure([i], imports)
        programs.append(Program(files[i].path, members, frozenset(members)))
    reached = {j for p in programs for j in p.files}
    rest = [i for i in range(len(files)) if i not in reached]
    if rest:
        programs.append(Program(None, tuple(range(len(files))), frozenset(rest)))
    return programs


def _closure(start: list[int], imports: list[set[int]]) -> tuple[int, ...]:
    seen, todo = list(start), list(start)
    while todo:
        for j in sorted(imports[todo.pop()]):
            if j not in seen:
                seen.append(j)
                todo.append(j)
    return (*start, *sorted(j for j in seen if j not in start))


def _parts(path: str) -> Parts:
    return Path(os.path.abspath(path)).parts


def _has_main_block(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.comparators) == 1:
            sides = [node.test.left, node.test.comparators[0]]
            names = {s.id for s in sides if isinstance(s, ast.Name)}
            consts = {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__"} and consts == {"__main__"}:
                return True
    return False


def _runs_code(tree: ast.Module) -> bool:
    """Module-level code beyond definitions: a call statement or a loop (a script written
    without a `__main__` block)."""
    return any(
        isinstance(n, (ast.For, ast.While, ast.With)) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
        for n in tree.body
    )


class _ModuleIndex:
    """Which checked file a dotted module name is, seen from one file."""

    def __init__(self, where: list[Parts]):
        self.where = where
        self.by_suffix: dict[Parts, list[tuple[int, Parts]]] = {}  # module parts -> (file, root)
        self.by_folder: dict[Parts, list[int]] = {}
        self.exact: dict[Parts, int] = {}  # the path without ".py" -> file
        for i, parts in enumerate(where):
            self.exact[(*parts[:-1], parts[-1].removesuffix(".py"))] = i
            mod = parts[:-1] if parts[-1] == "__init__.py" else (*parts[:-1], parts[-1].removesuffix(".py"))
            for k in range(1, len(mod)):
                self.by_suffix.setdefault(mod[-k:], []).append((i, mod[:-k]))
            self.by_folder.setdefault(parts[:-1], []).append(i)

    def find(self, name: Parts, near: Parts, under: bool = False) -> list[int]:
        """Files that module `name` may be: those whose root (the folder the module path
        starts from) holds `near` (an importer's folder: sys.path[0] or a parent put on
        the path), or with `under`, lies inside `near` (a config file's project); else,
        for a dotted name, the one file of that name in the run (an installed package)."""
        cands = self.by_suffix.get(name, [])
        ok = [i for i, root in cands if (root == near[: len(root)] if not under else root[: len(near)] == near)]
        if ok:
            return ok
        return [cands[0][0]] if len(cands) == 1 and len(name) > 1 else []

    def package_files(self, name: Parts, near: Parts) -> list[int]:
        """The files directly inside a dotted package whose `__init__` is not checked
        (`import fourm.utils as utils` with fourm/utils/dist.py checked): what the missing
        `__init__` re-exports, as far as the doctor can tell. A one-part name is only a
        folder beside the importer (`from data import build_loader` with data/build.py):
        elsewhere it may be an installed package of that name."""
        out = []
        for folder, fs in self.by_folder.items():
            if len(name) < 2 and folder != (*near, *name):
                continue
            if folder[-len(name) :] == name and folder[: -len(name)] == near[: len(folder) - len(name)]:
                if not any(self.where[i][-1] == "__init__.py" for i in fs):
                    out += fs
        return out

    def imported_by(self, i: int, facts: Facts) -> set[int]:
        """The checked files file `i` imports, anywhere in it (an import inside a
        function runs when the function does)."""
        folder = self.where[i][:-1]
        out: set[int] = set()
        for node in facts.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    out |= self._dotted(tuple(a.name.split(".")), (), folder)
            elif isinstance(node, ast.ImportFrom):
                subs = tuple(a.name for a in node.names if a.name != "*")
                if node.level:
                    base = folder[: len(folder) - node.level + 1]
                    mod = (*base, *node.module.split(".")) if node.module else base
                    for m in [mod, *((*mod, s) for s in subs)]:
                        out |= {j for j in (self.exact.get(m), self.exact.get((*m, "__init__"))) if j is not None}
                elif node.module:
                    out |= self._dotted(tuple(node.module.split(".")), subs, folder)
            elif (name := _dynamic_import(node)) is not None:
                mod = tuple(name.split("."))
                out |= self._dotted(mod, (), folder) or set(self.find(mod[-1:], folder))
        out.discard(i)
        return out

    def _dotted(self, mod: Parts, subs: Parts, folder: Parts) -> set[int]:
        """`import a.b` runs a, a.b; `from a.b import c` also a.b.c when c is a module."""
        out: set[int] = set()
        for k in range(1, len(mod)):
            out |= set(self.find(mod[:k], folder))
        out |= set(self.find(mod, folder) or self.package_files(mod, folder))
        for s in subs:
            out |= set(self.find((*mod, s), folder))
        return out


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of `importlib.import_module("pkg.mod")` or `__import__("mod")`."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    value = node.args[0].value
    return value if name in ("import_module", "__import__") and isinstance(value, str) and value else None


# ----- console scripts ------------------------------------------------------------------

_TARGET = re.compile(r"^\s*[\w.\-\[\] ]+?\s*=\s*([\w.]+)\s*(?::\s*[\w.]+)?\s*$")


def _console_targets(files: list[Facts], paths: list[str], index: _ModuleIndex) -> list[int]:
    """Files that the console scripts of the checked folders' packages run."""
    folders = {_parts(p) for p in paths if os.path.isdir(p)} | {_parts(f.path)[:-1] for f in files}
    out: list[int] = []
    for folder in sorted(folders):
        for module in _scripts_in(Path(*folder)):
            out += index.find(tuple(module.split(".")), folder, under=True)
    return out


def _scripts_in(folder: Path) -> list[str]:
    """Module names of the console scripts a pyproject.toml, setup.cfg or setup.py in
    `folder` declares (unreadable or malformed files declare none)."""
    specs: list[str] = []
    try:
        if (folder / "pyproject.toml").is_file():
            import tomllib

            doc = tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))
            for table in (
                doc.get("project", {}).get("scripts", {}),
                doc.get("project", {}).get("gui-scripts", {}),
                doc.get("tool", {}).get("poetry", {}).get("scripts", {}),
            ):
                specs += [f"x = {v}" for v in table.values() if isinstance(v, str)]
        if (folder / "setup.cfg").is_file():
            cfg = configparser.ConfigParser()
            cfg.read_string((folder / "setup.cfg").read_text(encoding="utf-8"))
            if cfg.has_option("options.entry_points", "console_scripts"):
                specs += cfg.get("options.entry_points", "console_scripts").splitlines()
        if (folder / "setup.py").is_file():
            specs += _setup_py_scripts(ast.parse((folder / "setup.py").read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, SyntaxError, configparser.Error):
        pass
    return [m.group(1) for s in specs if (m := _TARGET.match(s))]


def _setup_py_scripts(tree: ast.Module) -> list[str]:
    """`entry_points={"console_scripts": ["name = pkg.mod:main", ...]}` in a setup() call."""
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(k, ast.Constant)
                    and k.value == "console_scripts"
                    and isinstance(v, (ast.List, ast.Tuple))
                ):
                    out += [e.value for e in v.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return out
