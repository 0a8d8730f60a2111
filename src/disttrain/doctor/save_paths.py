"""Where a save goes and whether it is moved into place: the calls that write a
checkpoint besides torch.save (`accelerator.save`) and the atomic moves after one (the
non-atomic-save rule asks)."""

from __future__ import annotations

import ast

from disttrain.doctor.facts import Facts, mentions, ref


def accelerator_saves(facts: Facts) -> list[ast.Call]:
    """`accelerator.save(obj, path)` (`self.accelerator.save`): Accelerate's torch.save."""
    return [
        c
        for c in facts.method_calls("save")
        if len(c.args) >= 2
        and isinstance(c.func, ast.Attribute)
        and "accelerator" in (ref(c.func.value) or "").rsplit(".", 1)[-1].lower()
    ]


_ATOMIC_MOVES = ("os.replace", "os.rename", "shutil.move")


def atomic_moves(facts: Facts) -> list[ast.Call]:
    """os.replace/os.rename/shutil.move, and Path.replace(target)/Path.rename(target):
    one argument, unlike str.replace(old, new)."""
    out = list(facts.calls_to(*_ATOMIC_MOVES))
    for attr in ("replace", "rename"):
        out += [
            c
            for c in facts.method_calls(attr)
            if len(c.args) + len(c.keywords) == 1 and (facts.qualname(c.func) or "") not in _ATOMIC_MOVES
        ]
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


def moves_path(facts: Facts, move: ast.Call, path: ast.AST) -> bool:
    """The move takes the saved file (`os.replace(tmp, path)` after `torch.save(x, tmp)`),
    not another one (verl renames its tracker file after an in-place torch.save of data.pt)."""
    parts = list(move.args) + [k.value for k in move.keywords]
    if isinstance(move.func, ast.Attribute) and (facts.qualname(move.func) or "") not in _ATOMIC_MOVES:
        parts.append(move.func.value)  # Path.replace: `tmp.replace(path)`
    moved = set().union(*(_path_refs(facts, a) for a in parts)) if parts else set()
    return bool(moved & _path_refs(facts, path)) or not _path_refs(facts, path)


_TEMP_WORDS = ("tmp", "temp", "atomic")


def in_temporary_dir(facts: Facts, call: ast.Call, path: ast.AST) -> bool:
    """The saved path is built from a parameter that every caller in view binds with
    `with self._temporary_wd(dir) as wd:` (OLMo-core): a working directory that the
    context manager renames into place once written."""
    fn = facts.scope_of(call)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    names = _path_refs(facts, path)
    for n in facts.nodes:  # one step back: `train_dir = wd / "train"`
        if isinstance(n, ast.Assign) and facts.scope_of(n) is fn and any(ref(t) in names for t in n.targets):
            names |= _path_refs(facts, n.value)
    params = [a.arg for a in fn.args.args]
    bound = 1 if params and params[0] in ("self", "cls") else 0
    sites = facts.project.call_sites.get(fn, [])
    hits = [i for i, p in enumerate(params) if p in names]
    return bool(sites and hits) and all(
        any(i - bound < len(c.args) and _bound_by_temporary_with(f, c.args[i - bound]) for i in hits) for f, c in sites
    )


def _bound_by_temporary_with(facts: Facts, value: ast.AST) -> bool:
    name = ref(value)
    return bool(name) and any(
        isinstance(n, ast.withitem)
        and n.optional_vars is not None
        and ref(n.optional_vars) == name
        and isinstance(n.context_expr, ast.Call)
        and any(w in (ref(n.context_expr.func) or "").rsplit(".", 1)[-1].lower() for w in _TEMP_WORDS)
        for n in facts.nodes
    )


def ends_the_process(facts: Facts, call: ast.Call) -> bool:
    """The save's block ends with exit() / sys.exit(): a debug dump before the process
    stops (jukebox's save_outputs, ml-4m's batch dump on a non-finite loss), no checkpoint."""
    stmt = facts.parents.get(call)
    parent = facts.parents.get(stmt) if stmt is not None else None
    for field in ("body", "orelse"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and stmt in block:
            last = block[-1]
            return (
                last is not stmt
                and isinstance(last, ast.Expr)
                and isinstance(last.value, ast.Call)
                and ast.unparse(last.value.func) in ("exit", "sys.exit", "quit", "os._exit")
            )
    return False


def checkpoint_copies(facts: Facts, saves: list[ast.Call], path_of) -> list[ast.Call]:
    """`shutil.copyfile(full_path, last_path)` after `torch.save(state, full_path)` in the
    same function (DeepLearningExamples' Checkpointer): the copy writes the other name
    (the one a resume is given) in place, as torn as a direct save."""
    out = []
    for c in facts.calls_to("shutil.copyfile", "shutil.copy", "shutil.copy2"):
        if len(c.args) < 2 or _mentions_temp(facts, c.args[1]):
            continue
        src = _path_refs(facts, c.args[0])
        if src and any(
            facts.scope_of(s) is facts.scope_of(c)
            and s.lineno < c.lineno
            and path_of(s) is not None
            and src & _path_refs(facts, path_of(s))
            for s in saves
        ):
            out.append(c)
    return out


def _mentions_temp(facts: Facts, node: ast.AST) -> bool:
    return any(w in ast.unparse(node).lower() for w in _TEMP_WORDS)


def is_rank_word(word: str) -> bool:
    return "rank" in word.lower()


def per_process_word(word: str) -> bool:
    """The rank, or a name unique to the process or the call (`uuid4()`, `getpid()`)."""
    return is_rank_word(word) or word in ("uuid4", "uuid1", "getpid")


def per_rank_variable(facts: Facts, path: ast.AST, call: ast.Call, word=is_rank_word) -> bool:
    """The path is a variable built from the rank in the same function (`queue_path =
    os.path.join(dump, "queue" + str(args.rank) + ".pth")`, `name = f"..._{rank_save}.pkl"`)."""

    def refs(node):  # whole references only: `args.out`, not `args` or a method's owner
        return {
            ref(n)
            for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute)) and not isinstance(facts.parents.get(n), ast.Attribute)
        } - {None}

    names = refs(path)
    scope = facts.scope_of(call)
    variables = facts.rank_variables
    for _ in range(3):
        grown = set(names)
        for n in facts.nodes:
            if (
                isinstance(n, (ast.Assign, ast.For))
                and facts.scope_of(n) in (scope, facts.tree)
                and any(ref(t) in names for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
            ):
                n = n if isinstance(n, ast.Assign) else ast.Assign(targets=[n.target], value=n.iter)
                if mentions(n.value, word) or any(
                    ref(x) in variables for x in ast.walk(n.value) if isinstance(x, (ast.Name, ast.Attribute))
                ):
                    return True
                grown |= refs(n.value)
        if grown == names:
            break
        names = grown
    return False
