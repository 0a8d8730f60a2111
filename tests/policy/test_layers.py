"""The house keeps its layers: imports that only point down (import-linter contracts in
pyproject.toml), no import circles, unique file names, a light `import disttrain` that
installs no import hook."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path, config: Path = ROOT / "pyproject.toml") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def test_import_contracts_hold():
    proc = _lint(SRC)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The linter bites: runtime (low) importing train (high) is reported by name."""
    shutil.copytree(SRC / "disttrain", tmp_path / "disttrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "disttrain" / "runtime" / "collectives.py"
    target.write_text(target.read_text() + "\nfrom disttrain.train import job  # noqa\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0
    assert "disttrain.runtime is not allowed to import disttrain.train" in proc.stdout


def test_a_module_outside_every_layer_breaks_the_contract(tmp_path):
    """`exhaustive = true`: a new top-level module must be given a layer."""
    shutil.copytree(SRC / "disttrain", tmp_path / "disttrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "disttrain" / "stray.py").write_text('"""Not in any layer."""\n')
    proc = _lint(tmp_path)
    assert proc.returncode != 0
    assert "stray" in proc.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles():
    # imports under `if TYPE_CHECKING:` never run: naming a type is no circle
    assert _cycles(grimp.build_graph("disttrain", exclude_type_checking_imports=True)) == []


def test_file_names_are_unique():
    names = [p.name for p in (SRC / "disttrain").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


@pytest.mark.parametrize("module", ["disttrain", "disttrain.config", "disttrain.doctor", "disttrain.plan",
                                    "disttrain.cli", "disttrain.launch.run_command",
                                    "disttrain.guard.script_watchdog"])
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_import_disttrain_installs_no_import_hook():
    code = ("import sys; before = list(sys.meta_path); import disttrain, disttrain.train; "
            "assert sys.meta_path == before, sys.meta_path")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_public_api_unchanged():
    import disttrain as dt

    for name in dt.__all__:
        assert getattr(dt, name) is not None
    assert {"wrap", "Accumulator", "ElasticSampler", "Checkpointer", "distributed"} <= set(dt.__all__)
