"""No module reads another object's underscore attribute: a part that another module
needs is public, or reached through a function. An AST check over src/disttrain:
`x._name` where `x` is not `self`, `cls` or `super()` and the name is not a dunder, and
`from m import _name`, each named file:line.

Exempt: runtime/torch_compat.py (the one place for torch's private names), `os._exit`,
`sys._getframe`, `sys._current_frames`, and a namedtuple's `_replace`, `_asdict`,
`_fields`, `_make` (public API with an underscore so as not to clash with field names).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "disttrain"
EXEMPT_FILES = {"runtime/torch_compat.py"}
EXEMPT_CALLS = {("os", "_exit"), ("sys", "_getframe"), ("sys", "_current_frames")}
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(source: str, where: str) -> list[str]:
    """`where:line: what` for each read of another object's or module's private name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in EXEMPT_CALLS or node.attr in NAMEDTUPLE:
                continue
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("disttrain"):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def test_no_module_reads_another_objects_private_attribute():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel not in EXEMPT_FILES:
            found += private_reads(path.read_text(), f"src/disttrain/{rel}")
    assert not found, ("private names read from outside their object or module (make the name "
                       "public, or add a function):\n" + "\n".join(found))


def test_the_check_finds_what_it_must_and_not_what_it_must_not():
    """A look-alike of each kind: the check is not vacuous, and its exemptions hold."""
    bad = "job._acc.step\nfrom disttrain.train import _helper\nf(x)._y = 1\n"
    assert sorted(line.split(": ", 1)[1] for line in private_reads(bad, "m.py")) == \
        ["f(x)._y", "from disttrain.train import _helper", "job._acc"]
    fine = ("self._a\ncls._b\nsuper()._c()\nos._exit(1)\nsys._getframe(0)\np._replace(a=1)\n"
            "x.__class__\nfrom disttrain.train import public\n")
    assert private_reads(fine, "m.py") == []
