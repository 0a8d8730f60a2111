"""torch's private names are used in one module only, `disttrain.runtime.torch_compat`.

"Private", as this test checks it with `ast` over every file of src/disttrain:
1. an import of a torch module whose dotted path has a part with one leading
   underscore (`import torch._dynamo`, `from torch.distributed.algorithms._checkpoint...`),
   or of a name with one leading underscore from a torch module
   (`from torch.distributed.distributed_c10d import _world`);
2. an attribute with one leading underscore read or written on an expression that starts
   at a name a torch import bound (`torch._amp_...`, `nn.modules.batchnorm._BatchNorm`,
   `get_args_parser()._option_string_actions`), through attributes, calls and subscripts;
3. a name from TORCH_PRIVATE_ATTRS (torch internals reached through values the source
   cannot trace: a scheduler, an FSDP handle, a module's buffers) as an attribute or as a
   string (`getattr(m, "_handle")`, a tuple of names);
4. an attribute with one leading underscore on the interpreter modules of
   STDLIB_INTERNALS (`threading._shutdown`, `atexit._run_exitfuncs`).
Dunder names (`__version__`) are public.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from disttrain.runtime import torch_compat

SRC = Path(__file__).resolve().parents[2] / "src" / "disttrain"
ALLOWED = SRC / "runtime" / "torch_compat.py"
TORCH_PRIVATE_ATTRS = frozenset({
    "_last_lr", "_step_count",  # LRScheduler
    "_handle", "_param_infos", "_shapes", "_shared_param_infos",  # FSDP1's flat parameters
    "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod",  # wrapper name parts
    "_buffers", "_parameters", "_modules", "_non_persistent_buffers_set",  # nn.Module
    "_option_string_actions", "_actions",  # argparse, on torchrun's parser
    "_world", "_nested_dict", "_local_tensor",  # c10d, DCP, DTensor
})
STDLIB_INTERNALS = frozenset({"threading", "atexit"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_torch(module: str | None) -> bool:
    return module is not None and (module == "torch" or module.startswith("torch."))


def _bindings(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound by torch imports, and names bound to STDLIB_INTERNALS modules,
    anywhere in the file (a function's local import counts for the whole file)."""
    torch_names, stdlib_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if _is_torch(alias.name):
                    torch_names.add(bound)
                elif alias.name in STDLIB_INTERNALS:
                    stdlib_names.add(bound)
        elif isinstance(node, ast.ImportFrom) and _is_torch(node.module):
            torch_names.update(alias.asname or alias.name for alias in node.names)
    return torch_names, stdlib_names


def _root(node: ast.AST) -> str | None:
    """The name an expression like `a.b(c)[d].e` starts from (`a`)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _import_hits(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if _is_torch(a.name) and any(map(_private, a.name.split(".")))]
    if isinstance(node, ast.ImportFrom) and _is_torch(node.module):
        if any(map(_private, node.module.split("."))):
            return [node.module]
        return [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
    return []


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private name in `source`, by the rules of the module docstring."""
    tree = ast.parse(source)
    torch_names, stdlib_names = _bindings(tree)
    hits = []
    for node in ast.walk(tree):
        hits += [(node.lineno, f"import {name}") for name in _import_hits(node)]
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            own = root in ("self", "cls") and root not in torch_names  # our classes' own state
            if (node.attr in TORCH_PRIVATE_ATTRS and not own) or root in torch_names or root in stdlib_names:
                hits.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.Constant) and node.value in TORCH_PRIVATE_ATTRS:
            hits.append((node.lineno, repr(node.value)))
    return sorted(set(hits))


def test_no_private_torch_name_outside_the_compat_module():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path != ALLOWED:
            found += [f"{path.relative_to(SRC.parent)}:{line}: {what}"
                      for line, what in private_uses(path.read_text(encoding="utf-8"))]
    assert not found, ("private torch names outside disttrain/runtime/torch_compat.py (add a "
                       "function there, with the releases it was checked on and its fallback):\n"
                       + "\n".join(found))


def test_the_rules_see_each_kind_of_private_name():
    source = """
import threading
import torch, torch.distributed as dist
import torch._dynamo
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.distributed_c10d import _world
from torch.distributed.run import get_args_parser
torch._amp_foreach_non_finite_check_and_unscale_
dist.distributed_c10d._world
get_args_parser()._option_string_actions
scheduler._last_lr = []
getattr(module, "_handle", None)
threading._shutdown()
"""
    lines = [line for line, _ in private_uses(source)]
    assert lines == [4, 5, 6, 8, 9, 10, 11, 12, 13], private_uses(source)


def test_public_and_own_names_pass():
    source = """
import os, torch
from torch import nn
torch.__version__
self._scale = 1
os._exit(0)
nn.Module
obj._mine
self._handle = None
"""
    assert private_uses(source) == []


def test_the_compat_module_says_where_it_was_checked():
    """Each public function names the release(s) it was checked on and its fallback."""
    tree = ast.parse(ALLOWED.read_text(encoding="utf-8"))
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_"):
            doc = ast.get_docstring(fn) or ""
            assert "Checked on" in doc and ("allback" in doc or "No fallback" in doc), fn.name


def _names_from_inspect(depth: int = 2) -> str:
    """The name of the function `depth` frames up, as `inspect.stack()` gives it."""
    import inspect

    stack = inspect.stack()
    return stack[depth].function if len(stack) > depth else "no_method_name"


def test_quick_rendezvous_event_names_are_torchs_own():
    """The frame-based name equals torch's `inspect.stack()` one at every depth, and past
    the top of the stack; the replacement is installed where torchrun's handlers call it."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    own = dynamic_rendezvous.get_method_name
    if own is torch_compat._method_name:  # a launch earlier in this process installed it
        own = _names_from_inspect

    def record(name):  # as a handler's `_record` asks from inside its caller
        return name()

    def next_rendezvous(name, depth):
        return record(name) if depth == 2 else name(depth)

    try:
        torch_compat.quick_rendezvous_event_names()
        quick = dynamic_rendezvous.get_method_name
        assert quick is torch_compat._method_name and quick is not own
        for depth in (1, 2, 3):  # (0 is the function itself: its own name)
            assert next_rendezvous(quick, depth) == next_rendezvous(own, depth), depth
        assert next_rendezvous(quick, 2) == "next_rendezvous"
        assert quick(10_000) == own(10_000) == "no_method_name"
    finally:
        dynamic_rendezvous.get_method_name = own


def test_fallback_unscale_matches_the_fused_kernel():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf"), 1.0])]
    found = torch.zeros(1)
    torch_compat.unscale_and_check_([g.clone() for g in grads], found, torch.tensor([0.5]))
    fused = torch._amp_foreach_non_finite_check_and_unscale_
    saved = fused
    try:
        delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
        mine, found_mine = [g.clone() for g in grads], torch.zeros(1)
        torch_compat.unscale_and_check_(mine, found_mine, torch.tensor([0.5]))
    finally:
        torch._amp_foreach_non_finite_check_and_unscale_ = saved
    assert found_mine.item() == found.item() == 1.0
    assert torch.equal(mine[0], torch.tensor([1.0, 2.0]))


def test_fallback_flatten_matches_dcp():
    state = {"model": {"a": torch.zeros(1), "b": {"c": torch.ones(2)}}, "step": 3}
    assert set(torch_compat.flatten_state_dict(state)) == set(torch_compat._flatten(state, ""))
