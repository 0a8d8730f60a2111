"""Keep the benchmark suite from rotting: cheap unit checks of its parts, one quick
run of a small subset of `python -m bench`, and the CPU dry run of bench/gpu.sh.

No timing is asserted: the benchmarks report targets, tests only check that the
suite runs and writes what it promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, worker_env

sys.path.insert(0, str(ROOT))

from bench import code_diff, common, report  # noqa: E402
from bench.matrix import WORKLOADS  # noqa: E402


def test_summary_is_median_min_max():
    assert common.summary([3.0, 1.0, 2.0, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert common.fmt(common.summary([1.0, 2.0, 4.0]), digits=1) == "2.0 (1.0-4.0)"
    assert common.summary([]) == {}


def test_code_diff_ignores_comments_docstrings_and_indentation():
    plain = '"""doc"""\nx = 1\nfor i in range(3):\n    f(i)  # call\n'
    converted = '"""other doc"""\nimport dt\nx = 1\nwith dt.ctx():\n    for i in range(3):\n        f(i)\n'
    counts = code_diff.diff_counts(plain, converted)
    assert (counts["added"], counts["removed"]) == (2, 0)


def test_every_workload_converts_plain_and_parses():
    files = {name: spec[0] for name, spec in WORKLOADS.items() if name != "plain"}
    counts = code_diff.count_all(files)
    for name, c in counts.items():
        assert c["changed"] > 0, name
    # One word differs between the two disttrain scripts: the strategy.
    ddp = code_diff.diff_counts((common.WORKLOADS / "disttrain_ddp.py").read_text(),
                                (common.WORKLOADS / "disttrain_fsdp.py").read_text())
    assert (ddp["added"], ddp["removed"]) == (1, 1)


def test_report_merges_other_results(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "checkpoint.md").write_text("| save | 1 GB/s |\n")
    (results / "guard_overhead.md").write_text("## Guard overhead\n\nsmall\n")
    path = report.write(common.Options(out_dir=tmp_path), [])
    text = path.read_text()
    assert "## 5. Checkpoints" in text and "| save | 1 GB/s |" in text
    assert "## 6. Recovery" in text and "Pending" in text
    assert "## Guard overhead" in text
    assert "/tmp" not in text and "/work" not in text


@pytest.mark.timeout(240)
def test_quick_subset_writes_benchmarks(tmp_path):
    """`python -m bench --quick` on the cheapest jobs: one repeat of the DDP pair."""
    cmd = [sys.executable, "-m", "bench", "--quick", "--repeats", "1", "--steps", "2",
           "--sections", "overhead", "--only", "torch_ddp,disttrain_ddp", "--no-profile",
           "--output", str(tmp_path)]
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## 1. Overhead against hand-written PyTorch" in text
    assert "Command: `python -m bench --quick" in text and "Preliminary" in text
    data = json.loads((tmp_path / "bench" / "results" / "overhead.json").read_text())
    ddp = next(r for r in data["ratios"] if r["strategy"] == "ddp")
    assert ddp["step_s"]["n"] == 1, data["jobs"]
    assert (tmp_path / "bench" / "results" / "overhead.png").exists()


@pytest.mark.timeout(240)
def test_gpu_script_dry_run_on_cpu(tmp_path):
    env = worker_env(PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for variant in ("torch_fsdp2", "disttrain_fsdp"):
        r = json.loads((tmp_path / f"{variant}.json").read_text())
        assert r["dry_run"] and r["tokens_per_s"] > 0 and 0 <= r["mfu"] < 1
        assert "ckpt_async_stall_s" in r, r.get("ckpt_error")
    assert "| disttrain_fsdp |" in (tmp_path / "gpu.md").read_text()
