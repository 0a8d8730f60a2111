"""`disttrain train` checkpoints every N steps and resumes by itself from the newest
valid checkpoint, continuing exactly; a full disk with on_error='continue' warns and
keeps training (P-CKPT-1,2, P-ELASTIC-3)."""

import json
import shutil

import torch
from conftest import run_disttrain, worker_env

from disttrain.checkpoint import latest_valid

SMALL = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
         "--model.dropout=0.1", "--data.max_bytes=60000", "--train.steps=6",
         "--train.batch_size=4", "--train.eval_every=0", "--train.eval_batches=1",
         "--train.log_every=1", "--checkpoint.every=2", "--guard.enabled=false",
         "--parallel.nproc=1"]  # one process keeps it cheap; w=2 resume is in test_checkpoint.py


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_trainer_resumes_automatically_and_exactly(tmp_path):
    a = tmp_path / "a"
    first = run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--train.out_dir={a}"], timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = a / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004",
                                                             "step-00000006"]
    # a job that died after step 4's checkpoint: the same command resumes from it
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-00000006")
    (b / "metrics.jsonl").unlink()
    env = worker_env(DISTTRAIN_FAULT="enospc@checkpoint.shards:step=6")
    second = run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--train.out_dir={b}",
                            "--checkpoint.on_error=continue"], timeout=240, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "disk full" in second.stderr and "Training continues" in second.stderr
    assert sorted(_losses(b)) == [5, 6]  # only the steps after the resume ran
    assert _losses(b)[5] == _losses(a)[5] and _losses(b)[6] == _losses(a)[6]
    wa = torch.load(a / "model.pt", weights_only=True)
    wb = torch.load(b / "model.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # bit-identical final weights
    assert latest_valid(b / "checkpoints").name == "step-00000004"  # the failed save left it latest


def test_async_end_of_run_checkpoint_survives_an_earlier_failed_save(tmp_path):
    """Thread-mode async: step 4's save fails on the background thread; the end-of-run
    save (step 5) is still performed, then step 4's failure is reported."""
    env = worker_env(DISTTRAIN_FAULT="enospc@checkpoint.shards:step=4")
    base = [*SMALL, "--train.steps=5", "--checkpoint.async_mode=thread"]
    warn, stop = tmp_path / "continue", tmp_path / "stop"
    jobs = {out: run_disttrain(["train", "examples/tiny_gpt.toml", *base, f"--train.out_dir={out}",
                                f"--checkpoint.on_error={out.name}"], timeout=240, env=env)
            for out in (warn, stop)}
    assert jobs[warn].returncode == 0, jobs[warn].stderr[-3000:]
    assert "disk full" in jobs[warn].stderr and "Training continues" in jobs[warn].stderr
    assert jobs[stop].returncode != 0 and "Traceback" not in jobs[stop].stderr, jobs[stop].stderr[-3000:]
    for out, proc in jobs.items():
        assert "step-00000005 is now the latest checkpoint" in proc.stderr, proc.stderr[-3000:]
        assert latest_valid(out / "checkpoints").name == "step-00000005"
        assert not (out / "checkpoints" / "step-00000004").exists()
