"""Where a save goes and whether it is moved into place: the calls that write a
checkpoint besides torch.save (`accelerator.save`) and the atomic moves after one (the
non-atomic-save rule asks)."""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, ref


def _accelerator_saves(facts: Facts) -> list[ast.Call]:
    """`accelerator.save(obj, path)` (`self.accelerator.save`): Accelerate's torch.save."""
    return [c for c in facts.method_calls("save") if len(c.args) >= 2 and
            "accelerator" in (ref(c.func.value) or "").rsplit(".", 1)[-1].lower()]  # type: ignore[attr-defined]


_ATOMIC_MOVES = ("os.replace", "os.rename", "shutil.move")


def _moves(facts: Facts) -> list[ast.Call]:
    """os.replace/os.rename/shutil.move, and Path.replace(target)/Path.rename(target):
    one argument, unlike str.replace(old, new)."""
    out = list(facts.calls_to(*_ATOMIC_MOVES))
    for attr in ("replace", "rename"):
        out += [c for c in facts.method_calls(attr) if len(c.args) + len(c.keywords) == 1
                and (facts.qualname(c.func) or "") not in _ATOMIC_MOVES]
    return out


def _path_refs(facts: Facts, node: ast.AST) -> set[str]:
    """Whole references in `node` and their owners (`f.name` -> f.name, f), not modules or self."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute)) and not isinstance(facts.parents.get(n), ast.Attribute):
            r = ref(n)
            while r:
                out.add(r)
                r = r.rsplit(".", 1)[0] if "." in r else None
    return out - {"self", "os", "os.path", "shutil", "Path", "str"}


def _moves_path(facts: Facts, move: ast.Call, path: ast.AST) -> bool:
    """The move takes the saved file (`os.replace(tmp, path)` after `torch.save(x, tmp)`),
    not another one (verl renames its tracker file after an in-place torch.save of data.pt)."""
    parts = list(move.args) + [k.value for k in move.keywords]
    if isinstance(move.func, ast.Attribute) and (facts.qualname(move.func) or "") not in _ATOMIC_MOVES:
        parts.append(move.func.value)  # Path.replace: `tmp.replace(path)`
    moved = set().union(*(_path_refs(facts, a) for a in parts)) if parts else set()
    return bool(moved & _path_refs(facts, path)) or not _path_refs(facts, path)
