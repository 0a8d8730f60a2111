"""BENCHMARKS.md is one page of headlines, written from bench/results/ by `python -m bench
--report-only`: each summary linking a file that exists, and the
committed page is what the results render to (no hand edits, nothing stale)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from conftest import ROOT, worker_env


def test_benchmarks_page_is_the_rendered_headlines(tmp_path):
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results")
    proc = subprocess.run([sys.executable, "-m", "bench", "--report-only", "--output", str(tmp_path)],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (ROOT / "BENCHMARKS.md").read_text()
    assert (tmp_path / "BENCHMARKS.md").read_text() == page, "rerun `python -m bench --report-only`"
    links = re.findall(r"\]\((bench/results/[^)]+)\)", page)
    assert links and all((ROOT / link).exists() for link in links), links
