"""A new user's first `dt.Job` conversion and `disttrain train` run, row by row of the
traps they fell into (tests/workers/job_script.py is the converted script): each test
fails on the two-loop code that came before the one loop."""

from __future__ import annotations

import json
import os
import random
import runpy
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, WORKERS, built_once, run_disttrain, worker_env

import disttrain as dt
from disttrain.config import CheckpointConfig, Config

SCRIPT = str(WORKERS / "job_script.py")


def ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def weights(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


def run_script(out, *args, fault: str | None = None, launcher=("--nproc", "2")):
    env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
    return run_disttrain(["run", *launcher, SCRIPT, str(out), *args], timeout=200, env=env)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs (ddp with an eval every 6 steps, and fsdp) of 12 steps."""
    def run(tmp):
        refs = {strategy: tmp / f"ref-{strategy}" for strategy in ("ddp", "fsdp")}
        for strategy, out in refs.items():
            out.mkdir()
            ok(run_script(out, "--steps", "12", "--strategy", strategy, "--eval-every", "6"))
        return refs

    return built_once(tmp_path_factory, "job-user-path-refs", run)


def test_own_scheduler_step_is_one_user_error(tmp_path):
    """Row 1: the script kept its `sched.step()`; the schedule ran twice as fast."""
    with pytest.raises(dt.UserError, match=r"remove the script's own `scheduler.step\(\)`"):
        with dt.Job(tmp_path, checkpoint_every=0, progress=False) as job:
            model = job.wrap(torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
            loader = job.loader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
            job.resume(model=model, optimizer=opt, scheduler=sched)
            for (x,) in job.steps(loader, max_steps=4):
                job.backward(model(x).square().mean())
                sched.step()


def test_the_progress_bar_counts_steps_of_a_loop_that_logs_nothing(tmp_path, capsys):
    """examples/plain_to_disttrain.py logs no metric: its bar ended at "0/80" after 80 steps,
    and summary.json held NaN for its losses, which strict JSON readers refuse."""
    with dt.Job(tmp_path, checkpoint_every=0) as job:
        model = job.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = job.loader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
        job.resume(model=model, optimizer=opt)
        for (x,) in job.steps(loader, max_steps=5):
            job.backward(model(x).square().mean())
    bar = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train")]
    assert bar and "5/5" in bar[-1], bar
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["final_train_loss"] is None and summary["steps"] == 5  # no loss logged: null, not NaN


def test_own_optimizer_step_and_backward_are_user_errors(tmp_path):
    for mistake, message in (("step", r"own `optimizer\.step\(\)`"), ("backward", r"`loss\.backward\(\)` ran")):
        with pytest.raises(dt.UserError, match=message):
            with dt.Job(tmp_path / mistake, checkpoint_every=0, progress=False) as job:
                model = job.wrap(torch.nn.Linear(4, 1))
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                loader = job.loader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
                job.resume(model=model, optimizer=opt)
                for (x,) in job.steps(loader, max_steps=4):
                    loss = model(x).square().mean()
                    if mistake == "step":
                        job.backward(loss)
                        opt.step()
                    else:
                        loss.backward()
                        job.backward(loss)


def test_sigterm_with_loader_workers_saves_and_the_launcher_says_so(tmp_path):
    """Row 2: loader workers died of the SIGTERM, nothing was saved, the launcher said
    the workers had saved, exit 0."""
    cmd = [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2", SCRIPT, str(tmp_path),
           "--workers", "2", "--slow-batches", "0.01", "--steps", "400", "--ckpt-every", "100"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-4000:]
    assert "is killed by signal" not in out
    saved = [int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").glob("step-*")]
    assert saved and 3 <= max(saved) < 100, (saved, out[-3000:])  # not a periodic one: the stop's
    assert f"saved step {max(saved)}. The same command resumes from it." in out


def test_eval_every_n_is_sharded_and_includes_the_last_step(references):
    """Row 3: the first eval ran at "step 0", the last step was never evaluated, and each
    rank evaluated the whole eval set."""
    records = [json.loads(line) for line in (references["ddp"] / "evals.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in records})
    assert steps == [6, 12]
    for step in steps:
        per_rank = {rank: [i for r in records if r["step"] == step and r["rank"] == rank for i in r["indices"]]
                    for rank in (0, 1)}
        assert not set(per_rank[0]) & set(per_rank[1])  # split, not duplicated
        assert sorted(per_rank[0] + per_rank[1]) == list(range(100))
    final = [json.loads(line) for line in (references["ddp"] / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 12 and 0 <= final["heldout_accuracy"] <= 1 and "heldout_loss" in final


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fast_recovery_of_a_job_script_is_bit_identical(references, tmp_path, strategy):
    """`disttrain run --fast-recovery` gives a user's loop the warm spare and the state in
    memory: a kill -9 of a random rank at a random step ends bit-identical, each
    sample once, without a torchrun restart."""
    rng = random.Random(f"fast-{strategy}")
    rank, step = rng.randrange(2), rng.randrange(2, 12)
    log = ok(run_script(tmp_path, "--steps", "12", "--strategy", strategy, "--eval-every", "6",
                        "--record-samples", launcher=("--fast-recovery", "--nproc", "2"),
                        fault=f"kill@backward:rank={rank},step={step}"))
    assert "disttrain fault: kill" in log and "warm spare took over" in log, log[-3000:]
    assert "disttrain job: generation" in log and "disttrain train" not in log, log[-3000:]  # the way in
    assert "Traceback" not in log and "lost a peer" not in log  # the supervisor's one line
    ref, got = weights(references[strategy]), weights(tmp_path)
    assert all(torch.equal(ref[k], got[k]) for k in ref), f"kill of rank {rank} at step {step}"
    from disttrain.elastic import final_timeline

    records = [json.loads(line) for f in sorted((tmp_path / "samples").glob("*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    timeline = final_timeline(records)
    assert sorted(timeline) == list(range(1, 13))
    seen = [i for idx in timeline.values() for i in idx]
    assert len(seen) == len(set(seen)) == 192  # 12 steps x 16 samples of the shuffled epoch, once each
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples_seen"] == 192 and "tokens_seen" not in summary  # units right
    assert summary["wall_time_s"] >= summary["attempt_wall_time_s"]


def test_one_process_then_two_names_the_world_sizes_in_job_words(tmp_path, monkeypatch):
    """Row 7: a run started once without the launcher, then with 2 processes, failed with
    a message about `train.batch_size` and `elastic.batch_policy` and a traceback."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, str(tmp_path), "--steps", "4"])
    runpy.run_path(SCRIPT, run_name="__main__")  # without the launcher: in this process
    proc = run_script(tmp_path, "--steps", "8", launcher=("--nproc", "2", "--max-restarts", "2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "job.loader(batch_size=...)" in out and "batch_policy='rescale_lr'" in out
    assert "train.batch_size" not in out and "Traceback" not in out


def test_trainer_checkpoints_by_time_and_restarts_by_default(tmp_path):
    """Row 4: `disttrain train` with model/data factories killed -9 lost every step (no
    periodic checkpoint, no restarts) and refused --max-restarts."""
    proc = run_disttrain(["train", str(ROOT / "tests" / "byo" / "byo.toml"), "--train.steps=40",
                          "--checkpoint.every=0", "--checkpoint.every_s=0.3", "--data.num_workers=1",
                          f"--train.out_dir={tmp_path}", "--max-restarts", "2"],
                         timeout=240, env=worker_env(DISTTRAIN_FAULT="kill@backward:rank=1,step=30"))
    out = ok(proc)
    assert "disttrain fault: kill" in out and "resumed at step" in out, out[-3000:]
    resumed_at = int(out.split("resumed at step ")[1].split()[0])
    assert resumed_at > 0  # the clock saved without checkpoint.every
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed"] and summary["wall_time_s"] > summary["attempt_wall_time_s"]
    assert "n_layer" not in summary["config"]["model"]  # only the keys that apply
    assert "samples_seen" in summary and "tokens_seen" not in summary


def test_job_has_the_trainers_checkpoint_options(tmp_path):
    """Job lacked checkpoint.dir, async saves, fallback and on_error; a changed LR in a Job
    script was silently replaced by the checkpoint's."""
    def run(lr: float, steps: int) -> float:
        config = Config(checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpts"), async_mode="thread",
                                                    fallback=True, on_error="continue", every=2))
        with dt.Job(tmp_path / "out", config, progress=False) as job:
            model = job.wrap(torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            loader = job.loader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
            job.resume(model=model, optimizer=opt)
            for (x,) in job.steps(loader, max_steps=steps):
                job.backward(model(x).square().mean())
            return opt.param_groups[0]["lr"]

    assert run(0.1, 4) == 0.1
    assert sorted(p.name for p in (tmp_path / "ckpts").glob("step-*"))[-1] == "step-00000004"
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert run(0.05, 6) == 0.05  # this run's LR, not the checkpoint's


def test_oversubscription_with_one_thread_says_to_start_fewer_processes(monkeypatch):
    """Row 9: `--nproc 3` on 2 cores was told to set OMP_NUM_THREADS=1, which it was."""
    from disttrain.guard import sanity

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setattr(sanity, "usable_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.warns(sanity.NotDistributedWarning, match="--nproc 2") as record:
            sanity.check_threads()
    finally:
        torch.set_num_threads(threads)
    assert "OMP_NUM_THREADS" not in str(record[0].message)


def test_checkpoint_interval_default_is_documented_as_it_is():
    """Row 4: docs/checkpoints.md showed `every = 200` as if it were the default."""
    from disttrain.config import CheckpointConfig

    assert CheckpointConfig().every_s == 600.0
    assert "every_s = 600" in (ROOT / "docs" / "checkpoints.md").read_text()
    assert os.path.exists(ROOT / "docs" / "checkpoints.md")
