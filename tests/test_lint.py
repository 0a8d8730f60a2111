"""The lint gate: ruff over the package, the benchmarks, the tests, the examples and the
scripts, with the rules of pyproject.toml's [tool.ruff] (unused and undefined names,
syntax errors)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                           "src", "bench", "tests", "examples", "scripts"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
