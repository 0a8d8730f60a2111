"""Process plumbing written once (runtime/processes.py): the package
calls `prctl`, `gc.freeze` and `gc.unfreeze` only there and keeps no `global` of its
own (process-wide values live in `processes.STATE`); the parent-death signal really
ends a child whose parent is killed; a freeze for life is never thawed."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, worker_env

from disttrain.runtime import processes

SRC = ROOT / "src" / "disttrain"
PLUMBING = SRC / "runtime" / "processes.py"


def _trees():
    for path in sorted(SRC.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _calls_outside_plumbing(match) -> list[str]:
    found = []
    for path, tree in _trees():
        if path == PLUMBING:
            continue
        for node in ast.walk(tree):
            if match(node):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _is_gc_freeze(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("freeze", "unfreeze")
            and isinstance(node.value, ast.Name) and node.value.id == "gc")


def _is_prctl(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr == "prctl")
            or (isinstance(node, ast.Name) and node.id == "prctl")
            or (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "prctl"))


def test_the_scan_finds_what_it_looks_for():
    """The matchers below are not vacuous: they see the one site that is allowed."""
    tree = ast.parse(PLUMBING.read_text())
    assert any(_is_gc_freeze(n) for n in ast.walk(tree))
    assert any(_is_prctl(n) for n in ast.walk(tree))
    assert _is_gc_freeze(ast.parse("gc.freeze()").body[0].value.func)  # type: ignore[attr-defined]


def test_gc_freeze_is_called_only_in_processes():
    assert _calls_outside_plumbing(_is_gc_freeze) == [], "call processes.freeze_long_lived instead"


def test_prctl_is_called_only_in_processes():
    assert _calls_outside_plumbing(_is_prctl) == [], "call processes.die_with_parent / set_name instead"


def test_no_module_keeps_a_global_of_its_own():
    """A process-wide value is a field of `processes.STATE`, not a `global` rebound in
    some module: one place says what describes the process."""
    found = _calls_outside_plumbing(lambda n: isinstance(n, ast.Global))
    found += [f"{PLUMBING.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(ast.parse(PLUMBING.read_text()))
              if isinstance(n, ast.Global)]
    assert found == []


def test_first_time_says_yes_once_per_key():
    key = "test_processes: once"
    processes.STATE.said.discard(key)
    assert processes.first_time(key) and not processes.first_time(key)
    assert processes.first_time(key + " (another)")


FREEZES = """
import gc
from disttrain.runtime import processes
processes.freeze_long_lived()
ours = processes.thaw_long_lived(), gc.get_freeze_count()
processes.freeze_long_lived()
processes.freeze_long_lived(for_life=True)  # a warm server's freeze after one of ours
for_life = processes.thaw_long_lived(), gc.get_freeze_count() > 0
print(ours, for_life)
"""


def test_a_freeze_for_life_is_never_thawed():
    proc = subprocess.run([sys.executable, "-c", FREEZES], capture_output=True, text=True, timeout=60,
                          env=worker_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "(True, 0) (False, True)"


# The parent starts a child that asks for the parent-death signal, says it is ready,
# and would then sleep a minute; the parent says the child's pid and sleeps too.
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
import time; time.sleep(60)
"""
CHILD = """
import time
from disttrain.runtime import processes
assert processes.die_with_parent()
print("ready", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has died; its new parent has yet to reap it


def test_a_child_dies_with_its_killed_parent():
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True,
                              env=worker_env())
    child = -1
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # a bound on the wait, not a timing assertion
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its parent: no parent-death signal"
    finally:
        parent.kill()
        if child > 0 and _alive(child):
            os.kill(child, signal.SIGKILL)
