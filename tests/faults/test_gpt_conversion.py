"""The GPT conversion kept in examples/: gpt_torchrun.py (plain torchrun and DDP, launched
as its user launches it: `torchrun --standalone`) and gpt_job.py (the same training on
`dt.Job`, under `disttrain run`) both train on a token file they write themselves; the Job
version killed -9 resumes to the uninterrupted run's weights; the diff size stated in its
docstring and the README is the one bench/code_diff.py counts; and every name it uses is
in the API reference."""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, built_once, run_disttrain, worker_env

import disttrain as dt

PLAIN, JOB = "examples/gpt_torchrun.py", "examples/gpt_job.py"
STEPS = 6
# A 1-layer, 32-wide model on 32-token windows: a few seconds per run on 2 cores.
TINY = ["--steps", str(STEPS), "--batch-size", "4", "--block-size", "32", "--n-layer", "1",
        "--n-head", "2", "--n-embd", "32", "--warmup", "2", "--log-every", "2",
        "--eval-every", "3", "--eval-batches", "2", "--ckpt-every", "3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    def build(folder):
        proc = subprocess.run([sys.executable, PLAIN, "--make-data", "--data", str(folder),
                               "--data-bytes", "100000"], cwd=ROOT, env=worker_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return str(folder)

    return built_once(tmp_path_factory, "gpt-conversion-data", build)


def launch(script, data, out, *extra, fault=None):
    env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
    args = [script, *TINY, "--data", data, "--out", str(out), *extra]
    if script == PLAIN:  # the script before its conversion, launched as it was
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=150)
    else:
        proc = run_disttrain(["run", "--nproc", "2", "--max-restarts", "3", *args], timeout=150, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def job_reference(tmp_path_factory, data):
    def build(out):
        log = launch(JOB, data, out)
        return log, torch.load(out / "model.pt", map_location="cpu", weights_only=True)

    return built_once(tmp_path_factory, "gpt-conversion-job", build)


def test_make_data_writes_byte_tokens_of_the_stdlib(data):
    train = torch.from_file(f"{data}/train.bin", size=1000, dtype=torch.int16)
    assert 0 <= int(train.min()) and int(train.max()) < 256  # one token per byte
    assert len(dt.TokenWindows(f"{data}/val.bin", 32)) > 0


def test_plain_script_trains_and_resumes_its_own_checkpoint(data, tmp_path):
    log = launch(PLAIN, data, tmp_path)
    losses = [float(v) for v in re.findall(r"val loss (\S+)", log)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), log[-3000:]  # steps 3 and 6
    assert f"done at step {STEPS}" in log
    log = launch(PLAIN, data, tmp_path, "--steps", str(STEPS + 2))
    assert f"at step {STEPS}" in log and f"done at step {STEPS + 2}" in log


def test_job_script_trains_to_a_finite_loss(job_reference):
    log, weights = job_reference
    assert f"done at step {STEPS}" in log and "Traceback" not in log
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_job_script_killed_9_resumes_to_the_same_weights(data, job_reference, tmp_path):
    log = launch(JOB, data, tmp_path, fault="kill@backward:rank=1,step=5")
    assert "disttrain fault: kill" in log and "resumed at step 3" in log, log[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == STEPS and math.isfinite(last["loss"]) and math.isfinite(last["heldout_loss"])
    got, reference = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True), job_reference[1]
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.equal(got[k], reference[k]), f"{k} differs from the uninterrupted run"


def test_stated_diff_size_is_the_counted_one(monkeypatch):
    """The docstring of gpt_job.py and the README state the count that
    `python -m bench.code_diff examples/gpt_torchrun.py examples/gpt_job.py` prints."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.code_diff import diff_counts

    changed = diff_counts((ROOT / PLAIN).read_text(), (ROOT / JOB).read_text())["changed"]
    doc = ast.get_docstring(ast.parse((ROOT / JOB).read_text()))
    stated = re.search(r"The change is (\d+) changed code lines", doc)
    assert stated and int(stated.group(1)) == changed, f"gpt_job.py's docstring: state {changed}"
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"examples/gpt_job\.py.{0,400}?(\d+) changed code lines", readme, re.DOTALL)
    assert stated and int(stated.group(1)) == changed, f"the README: state {changed}"
    assert "python -m bench.code_diff examples/gpt_torchrun.py examples/gpt_job.py" in readme


def _calls(tree):
    """(owner, attribute, keywords) of each `dt.X(...)`, `job.X(...)` and `dt.X` in the tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("dt", "job"):
            yield node.value.id, node.attr, ()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("dt", "job"):
            yield node.func.value.id, node.func.attr, tuple(k.arg for k in node.keywords)


def _job_reference_text() -> str:
    """The docstrings of `dt.Job` and of its public members: what its reference entry shows."""
    members = [getattr(dt.Job, n) for n in dir(dt.Job) if not n.startswith("_")]
    return "\n".join(inspect.getdoc(m) or "" for m in [dt.Job, *members])


def test_job_script_uses_only_names_of_the_api_reference():
    """No help() needed: each `dt.X` is in `disttrain.__all__` (the reference has one
    entry per name), each `job.X` a documented public member of `dt.Job`, and each
    keyword argument in the signature the reference shows."""
    used = list(_calls(ast.parse((ROOT / JOB).read_text())))
    assert {("dt", "Job"), ("dt", "TokenWindows"), ("job", "evaluator"), ("job", "steps")} <= \
        {(owner, name) for owner, name, _ in used}
    for owner, name, keywords in used:
        if owner == "dt":
            assert name in dt.__all__, f"dt.{name} is not in the API reference"
            target = getattr(dt, name)
        elif hasattr(dt.Job, name):
            assert not name.startswith("_"), f"job.{name} is private"
            target = getattr(dt.Job, name)
            assert inspect.getdoc(target), f"job.{name} has no reference entry (no docstring)"
        else:  # an attribute the job sets (job.step): its reference is the text that names it
            assert f"`job.{name}`" in _job_reference_text(), f"job.{name} is in no docstring of dt.Job"
            continue
        if keywords:
            if target is dt.Job.log:
                continue  # job.log(**values): any name is a metric
            params = inspect.signature(target).parameters
            missing = [k for k in keywords if k not in params]
            assert not missing, f"{owner}.{name}({', '.join(missing)}=...) is not in its signature"
