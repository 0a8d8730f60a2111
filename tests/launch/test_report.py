"""`disttrain report` on written run directories: its marks from run_events.jsonl, the
sample audit or the metrics alone; one-line errors; no torch import. The report of a
real killed-and-resized run is in tests/faults/test_tensorboard.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_disttrain, worker_env

from disttrain.report import load_run, report


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def record(step: int, world: int, attempt: int = 0, loss: float = 3.0) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 1000.0 * world, "world_size": world,
            "step_time_s": [0.01 * (r + 1) for r in range(world)], "step_time_max_s": 0.01 * world,
            "step_time_min_s": 0.01, "peak_mem_mb": [100.0] * world, "attempt": attempt}


def three_attempts(run):
    """Attempt 0 on 2 ranks logs 1..6 and dies; attempt 1 resumes at 4 on 2 ranks and
    logs 5..8; attempt 2 resumes at 8 on 4 ranks and logs 9..12."""
    rows = [record(s, 2, 0) for s in range(1, 7)] + [record(s, 2, 1, 2.5) for s in range(5, 9)]
    rows += [record(s, 4, 2) for s in range(9, 13)]
    rows[3]["heldout_loss"] = 3.1
    write_jsonl(run / "metrics.jsonl", rows)


def test_marks_from_run_events(tmp_path):
    three_attempts(tmp_path)
    write_jsonl(tmp_path / "run_events.jsonl", [
        {"attempt": 0, "step": 0, "resumed": False, "world_size": 2, "prev_world_size": None},
        {"attempt": 1, "step": 4, "resumed": True, "world_size": 2, "prev_world_size": 2},
        {"attempt": 2, "step": 8, "resumed": True, "world_size": 4, "prev_world_size": 2}])
    side = report(tmp_path)
    assert [(m["step"], m["kind"]) for m in side["marks"]] == [(4, "restart"), (8, "restart"),
                                                               (8, "world_size")]
    assert side["marks_from"] == "run_events.jsonl" and side["attempts"] == 3
    assert json.loads((tmp_path / "report.json").read_text())["marks"] == side["marks"]
    data = load_run(tmp_path)
    assert [r["step"] for r in data.records] == list(range(1, 13))
    assert data.records[4]["loss"] == 2.5  # step 5 of the resumed attempt, not the killed one
    assert [r["step"] for r in data.superseded] == [5, 6]
    rows = dict(side["table"])
    assert rows["attempts / restarts"] == "3 / 2 (at steps 4, 8)"
    assert rows["tokens/s on 4 rank(s), median"] == "4,000"


def test_marks_from_the_sample_audit_without_run_events(tmp_path):
    three_attempts(tmp_path)
    audit = [{"step": s, "rank": r, "world": w, "generation": g, "indices": [s]}
             for g, w, steps in ((100, 2, range(1, 7)), (200, 2, range(5, 9)), (300, 4, range(9, 13)))
             for s in steps for r in range(w)]
    write_jsonl(tmp_path / "samples" / "all.jsonl", audit)
    data = load_run(tmp_path)
    assert data.source == "samples/"
    assert [(m.step, m.kind) for m in data.marks] == [(4, "restart"), (8, "restart"), (8, "world_size")]


def test_marks_from_metrics_alone(tmp_path):
    three_attempts(tmp_path)
    data = load_run(tmp_path)
    assert data.source == "metrics.jsonl"
    assert [(m.step, m.kind, m.label) for m in data.marks] == [
        (4, "restart", "restart 1: resumed at step 4"), (8, "restart", "restart 2: resumed at step 8"),
        (8, "world_size", "world size 2 -> 4")]


@pytest.mark.parametrize("case", ["missing", "no_metrics", "empty", "not_png"])
def test_one_line_errors(tmp_path, case):
    run, args = tmp_path / "run", []
    if case != "missing":
        run.mkdir()
    if case in ("empty", "not_png"):
        (run / "metrics.jsonl").write_text("" if case == "empty" else json.dumps(record(1, 1)) + "\n")
    if case == "not_png":
        args = ["--out", str(tmp_path / "r.jpg")]
    proc = run_disttrain(["report", str(run), *args], timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    expected = {"missing": "does not exist", "no_metrics": "has no metrics.jsonl",
                "empty": "has an empty metrics.jsonl", "not_png": "must name a .png file"}[case]
    assert expected in proc.stderr, proc.stderr


def test_report_imports_no_torch(tmp_path):
    three_attempts(tmp_path)
    code = ("import sys; from disttrain.cli import main; rc = main(['report', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=worker_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "report.png").exists()
