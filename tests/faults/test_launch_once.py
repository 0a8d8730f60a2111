"""`disttrain train` parses the config, runs the preflight and inspects the checkpoint
once, in the launcher; a rank's first attempt takes the launcher's result
(`train.launched`) and parses and inspects nothing, a restarted rank does both itself.
Counted in real launches (2 gloo processes on CPU) by tests/call_counter/sitecustomize.py,
which wraps those functions in every process of the job."""

import json
import os
from collections import Counter
from pathlib import Path

from conftest import run_disttrain, worker_env

COUNTER = Path(__file__).resolve().parents[1] / "call_counter"
SMALL = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
         "--data.max_bytes=200000", "--train.batch_size=8", "--train.eval_every=0",
         "--train.eval_batches=2", "--train.log_every=1", "--checkpoint.every=2"]
PARSE, PREFLIGHT, INSPECT, TRAIN = ("disttrain.config.schema.load_config", "disttrain.launch.preflight.preflight",
                                    "disttrain.train.resume_plan.inspect", "disttrain.train.trainer.train")


def _counted_train(tmp_path: Path, log: Path, *args: str, **env: str):
    """`disttrain train` of the small config with every call of `COUNTED` logged; returns
    the calls made, each as (rank or None for the launcher, restart, function)."""
    environ = worker_env(DISTTRAIN_TEST_COUNT_CALLS=str(log), **env)
    environ["PYTHONPATH"] += os.pathsep + str(COUNTER)
    log.unlink(missing_ok=True)
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--train.out_dir={tmp_path / 'run'}",
                          *args], timeout=300, env=environ)
    assert proc.returncode == 0, proc.stderr[-4000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [(c["rank"], c["restart"], c["fn"]) for c in calls], proc


def test_launcher_parses_preflights_and_inspects_once_and_first_attempt_ranks_take_its_result(tmp_path):
    log = tmp_path / "calls.jsonl"
    # a fresh run whose rank 1 is killed in step 3: torchrun restarts both ranks once
    calls, _ = _counted_train(tmp_path, log, "--train.steps=4", "--max-restarts", "1",
                              DISTTRAIN_FAULT="kill@step:rank=1,step=3")
    launcher = Counter(fn for rank, _, fn in calls if rank is None)
    assert launcher == {PARSE: 1, PREFLIGHT: 1, INSPECT: 1}, calls
    first = Counter((rank, fn) for rank, restart, fn in calls if rank is not None and restart == "0")
    assert first == {("0", TRAIN): 1, ("1", TRAIN): 1}, calls  # counted, and nothing but train
    again = Counter((rank, fn) for rank, restart, fn in calls if rank is not None and restart == "1")
    assert again == {(r, fn): 1 for r in ("0", "1") for fn in (PARSE, INSPECT, TRAIN)}, calls
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    # continued: the launcher's inspection finds step 4; the ranks resume from it unread
    calls, proc = _counted_train(tmp_path, log, "--train.steps=6")
    assert Counter(fn for rank, _, fn in calls if rank is None) == {PARSE: 1, PREFLIGHT: 1, INSPECT: 1}
    assert Counter((rank, fn) for rank, _, fn in calls if rank is not None) == {("0", TRAIN): 1, ("1", TRAIN): 1}
    assert "resumed at step 4" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6
