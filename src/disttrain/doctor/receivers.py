"""Which project classes a method call's receiver may be: a method call is resolved
through what it is called on, never by the method's name alone.

Contract: `receiver_classes(classes, facts, call)` takes the project's classes (name ->
[(facts, ClassDef)]) and an `obj.f(...)` call, and returns the names of the project
classes whose `f` the call may run. `self.f()` / `cls.f()`: the enclosing class, its
bases and its subclasses in view (an overridden or template method runs in whichever
class the object is). `super().f()`: the bases. `x.f()` / `self.x.f()`: the classes `x`
is built from in its scope (`x = Trainer(...)`, `self.x = Trainer(...)` in the class, an
annotation `x: Trainer`). Anything else (a tokenizer from a library, a parameter of
unknown type) is empty: the call is not a project method the doctor can name.
"""

from __future__ import annotations

import ast

from disttrain.doctor.names import ref


def receiver_classes(classes: dict, facts, call: ast.Call) -> set[str]:
    head = call.func.value  # type: ignore[attr-defined]
    own = _enclosing_class(facts, call)
    if isinstance(head, ast.Name) and head.id in ("self", "cls"):
        return _family(classes, own.name) if own is not None else set()
    if isinstance(head, ast.Call) and isinstance(head.func, ast.Name) and head.func.id == "super":
        return _ancestors(classes, own.name) - {own.name} if own is not None else set()
    name = ref(head)
    if name is None:
        return set()
    if name.startswith("self.") and name.count(".") == 1:
        where: ast.AST | None = own
    else:
        where = facts.scope_of(call)
    built = _built_from(classes, facts, where, name) if where is not None else set()
    return {c for b in built for c in _ancestors(classes, b)}


def _enclosing_class(facts, node: ast.AST) -> ast.ClassDef | None:
    for a in facts.ancestors(node):
        if isinstance(a, ast.ClassDef):
            return a
    return None


# The bases of each class and each class's family, per class table (one per program):
# asked for every method call, so worked out once. Holds the table itself so that its
# id is not reused while cached; the few latest tables only.
_TABLES: dict[int, tuple[dict, dict[str, set[str]], dict[str, set[str]]]] = {}


def _table(classes: dict) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    held = _TABLES.get(id(classes))
    if held is None or held[0] is not classes:
        if len(_TABLES) > 8:
            _TABLES.clear()
        bases = {n: {ast.unparse(b).split(".")[-1] for _, c in cs for b in c.bases} for n, cs in classes.items()}
        held = _TABLES[id(classes)] = (classes, bases, {})
    return held[1], held[2]


def _bases(classes: dict, name: str) -> set[str]:
    return _table(classes)[0].get(name, set())


def _ancestors(classes: dict, name: str) -> set[str]:
    """The class and its bases in view, to the top (a method may be inherited)."""
    out, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += [b for b in _bases(classes, n) if b in classes]
    return out


def _family(classes: dict, name: str) -> set[str]:
    """The class, its bases and every subclass in view of any of them."""
    memo = _table(classes)[1]
    if name not in memo:
        family = _ancestors(classes, name)
        changed = True
        while changed:
            more = {n for n in classes if n not in family and _bases(classes, n) & family}
            family |= more
            changed = bool(more)
        memo[name] = family
    return set(memo[name])


def _built_from(classes: dict, facts, where: ast.AST, name: str) -> set[str]:
    """The project classes `name` is bound to in `where` (a function, a module or, for
    `self.x`, a class): `name = Cls(...)`, `name: Cls = ...`, a parameter `name: Cls`."""
    cache = facts.__dict__.setdefault("_receiver_classes", {})
    key = (id(where), name)
    if key not in cache:
        cache[key] = _bindings(classes, where, name)
    return cache[key]


def _bindings(classes: dict, where: ast.AST, name: str) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(where):
        if isinstance(n, ast.Assign) and any(ref(t) == name for t in n.targets):
            out |= _class_called(classes, n.value)
        elif isinstance(n, ast.AnnAssign) and ref(n.target) == name:
            out |= _class_named(classes, n.annotation) | (_class_called(classes, n.value) if n.value else set())
        elif isinstance(n, ast.arg) and n.arg == name and n.annotation is not None:
            out |= _class_named(classes, n.annotation)
    return out


def _class_called(classes: dict, value: ast.AST) -> set[str]:
    if isinstance(value, ast.IfExp):
        return _class_called(classes, value.body) | _class_called(classes, value.orelse)
    if isinstance(value, ast.Call):
        last = ast.unparse(value.func).split(".")[-1]
        return {last} if last in classes else set()
    return set()


def _class_named(classes: dict, annotation: ast.AST) -> set[str]:
    last = ast.unparse(annotation).strip("'\"").split(".")[-1]
    return {last} if last in classes else set()
