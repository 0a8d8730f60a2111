"""The gates of the test command: ruff's lint over the package, the benchmarks, the tests,
the examples and the scripts (rules in pyproject.toml's [tool.ruff]); ruff's formatter
and the type checker (mypy, [tool.mypy]) over the package and the benchmarks."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing():
    proc = _run("ruff", "check", "--output-format", "concise", "src", "bench", "tests", "examples", "scripts")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_package_and_benchmarks_are_formatted():
    proc = _run("ruff", "format", "--check", "src", "bench")
    assert proc.returncode == 0, "run `ruff format src bench`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]


def test_type_checker_finds_nothing():
    proc = _run("mypy", timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
