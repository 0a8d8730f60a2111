"""`disttrain train` on an out_dir with a checkpoint compares the checkpoint's config with
this run's (docs/resume_plan.md): a changed model or dataset is refused with one line and
nothing written, changed hyper-parameters are applied, and a finished run is left alone."""

import json
import shutil

import pytest
import torch
from conftest import built_once, run_disttrain

from disttrain.checkpoint import CheckpointMismatch
from disttrain.config import load_config, to_dict
from disttrain.train import resume_plan
from disttrain.train.accumulation import warmup_cosine

SMALL = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
         "--data.max_bytes=50000", "--train.batch_size=4", "--train.eval_every=0",
         "--train.eval_batches=1", "--train.log_every=1", "--checkpoint.every=3",
         "--guard.enabled=false", "--parallel.nproc=1", "--optim.lr=1e-3"]
COMPLETE = ("disttrain train: complete at step 3; raise --train.steps to continue, or use "
            "another --train.out_dir.")


def _train(out, *extra, steps=3):
    return run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--train.steps={steps}",
                          *extra, f"--train.out_dir={out}"], timeout=240)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 3 steps with its checkpoint at step 3, trained once for the module."""
    def run(tmp):
        out = tmp / "base"
        proc = _train(out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    return built_once(tmp_path_factory, "resume-finished", run)


def _copy(finished, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(finished, out)
    return out


def _snapshot(out):
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(out.rglob("*")) if p.is_file()}


def _records(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _expected_lrs(lr, total, steps):
    """The LR logged after each of `steps` in a run started at `lr` with `total` steps."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = warmup_cosine(opt, total_steps=total, warmup_steps=-1, min_lr_ratio=0.1)
    out = {}
    for step in range(1, max(steps) + 1):
        opt.step()
        sched.step()
        out[step] = sched.get_last_lr()[0]
    return {s: out[s] for s in steps}


def test_complete_run_is_left_untouched(finished, tmp_path):
    out = _copy(finished, tmp_path, "again")
    before = _snapshot(out)
    proc = _train(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert COMPLETE in (proc.stdout + proc.stderr).splitlines()
    assert "resumed" not in proc.stdout and "summary" not in proc.stdout
    assert _snapshot(out) == before  # model.pt, summary.json, metrics.jsonl, checkpoints


def test_complete_run_says_only_that_and_what_a_continuation_would_change(finished, tmp_path):
    """Not a "config changed (applied)" table followed by "complete": one line."""
    out = _copy(finished, tmp_path, "lr")
    before = _snapshot(out)
    proc = _train(out, "--optim.lr=2e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert said == [COMPLETE + " Continued, it would apply the changes since the checkpoint: "
                               "optim.lr 0.001 -> 0.002."], said
    assert _snapshot(out) == before


def test_changed_model_or_data_refuses_in_one_line(finished, tmp_path):
    out = _copy(finished, tmp_path, "shape")
    before = _snapshot(out)
    proc = _train(out, "--model.n_embd=64", "--data.max_bytes=60000", steps=6)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("disttrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.n_embd: 32 -> 64" in errors[0] and "data.max_bytes: 50000 -> 60000" in errors[0]
    assert "step-00000003" in errors[0] and "another --train.out_dir" in errors[0]
    assert _snapshot(out) == before


def test_changed_lr_and_schedule_are_applied(finished, tmp_path):
    kept, changed = _copy(finished, tmp_path, "kept"), _copy(finished, tmp_path, "changed")
    a = _train(kept, steps=6)
    b = _train(changed, "--optim.lr=5e-3", steps=6)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-3000:], b.stderr[-3000:])
    assert "resumed at step 3" in b.stdout + b.stderr  # the disttrain logger (stderr)
    rows = [line for line in b.stdout.splitlines() if "optim.lr" in line or "train.steps" in line]
    assert len(rows) == 2 and "0.001" in rows[0] and "0.005" in rows[0], b.stdout
    assert "train.steps" in a.stdout and "optim.lr" not in a.stdout  # only what changed
    ra, rb = _records(kept), _records(changed)
    # the LR at each resumed step is the new run's schedule: lr and total steps of this run
    assert {s: rb[s]["lr"] for s in (4, 5, 6)} == _expected_lrs(5e-3, 6, (4, 5, 6))
    assert {s: ra[s]["lr"] for s in (4, 5, 6)} == _expected_lrs(1e-3, 6, (4, 5, 6))
    assert ra[4]["loss"] == rb[4]["loss"]  # the same weights at the checkpoint ...
    assert ra[5]["loss"] != rb[5]["loss"]  # ... then the new LR trains differently
    wa = torch.load(kept / "model.pt", weights_only=True)
    wb = torch.load(changed / "model.pt", weights_only=True)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def _adamw(params, cfg):
    o = cfg.optim
    decay = [p for p in params if p.dim() >= 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas))
    return opt, warmup_cosine(opt, total_steps=cfg.train.steps, warmup_steps=o.warmup_steps,
                              min_lr_ratio=o.min_lr_ratio)


def test_apply_matches_a_run_started_with_the_new_config(tmp_path):
    old = load_config(None, ["--train.steps=10", "--optim.lr=1e-3", "--parallel.nproc=1"])
    new = load_config(None, ["--train.steps=20", "--optim.lr=4e-3", "--optim.weight_decay=0.3",
                             "--optim.betas=[0.8, 0.9]", "--optim.warmup_steps=2",
                             "--parallel.nproc=1"])
    model = torch.nn.Linear(3, 2)
    opt, sched = _adamw(list(model.parameters()), old)
    for _ in range(4):
        opt.step()
        sched.step()
    (tmp_path / "state.json").write_text(json.dumps({"step": 4, "config": to_dict(old)}))
    plan = resume_plan.plan_for(tmp_path, new).check()
    assert [k for k, _, _ in plan.changes] == ["optim.betas", "optim.lr", "optim.warmup_steps",
                                               "optim.weight_decay", "train.steps"]
    opt2, sched2 = _adamw(list(model.parameters()), new)
    fresh = resume_plan.fresh_hyperparams(opt2, sched2)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    resume_plan.apply(plan, opt2, sched2, fresh)
    ref, ref_sched = _adamw(list(model.parameters()), new)
    for _ in range(4):
        ref.step()
        ref_sched.step()
    for got, want in zip(opt2.param_groups, ref.param_groups, strict=False):
        assert {k: v for k, v in got.items() if k != "params"} == \
               {k: v for k, v in want.items() if k != "params"}
    assert sched2.base_lrs == ref_sched.base_lrs and sched2.get_last_lr() == ref_sched.get_last_lr()


def test_classes_of_keys():
    assert resume_plan.classify("model.n_embd") == resume_plan.classify("data.max_bytes") == "refuse"
    assert resume_plan.classify("optim.name") == resume_plan.classify("train.seed") == "refuse"
    assert resume_plan.classify("optim.lr") == resume_plan.classify("model.dropout") == "apply"
    assert resume_plan.classify("train.batch_size") == resume_plan.classify("train.steps") == "apply"
    assert resume_plan.classify("train.precision") == resume_plan.classify("train.fp8_recipe") == "apply"
    assert resume_plan.classify("parallel.nproc") == resume_plan.classify("train.log_every") == "ignore"
    for knob in ("data.num_workers", "data.pin_memory", "data.persistent_workers", "train.compile",
                 "train.eval_every", "checkpoint.every", "checkpoint.every_s"):
        assert resume_plan.classify(knob) == "ignore", knob


def test_every_data_key_has_its_class():
    """A new [data] key must be put in one of the two sets: one that chooses the samples
    is the run's identity, one that only loads them is not."""
    import dataclasses

    from disttrain.config.data_config import DataConfig

    keys = {f"data.{f.name}" for f in dataclasses.fields(DataConfig)}
    assert keys == {k for k in resume_plan.IDENTITY if k.startswith("data.")} | resume_plan.NOT_IDENTITY


def test_refusal_names_only_identity_keys_and_what_each_changes(tmp_path):
    old = load_config(None, ["--parallel.nproc=1"])
    new = load_config(None, ["--parallel.nproc=1", "--model.n_embd=256", "--data.max_bytes=9000",
                             "--data.num_workers=3", "--data.pin_memory=true", "--train.compile=true",
                             "--train.log_every=7", "--optim.lr=0.5"])
    (tmp_path / "state.json").write_text(json.dumps({"step": 4, "config": to_dict(old)}))
    plan = resume_plan.plan_for(tmp_path, new)
    assert [k for k, _, _ in plan.changes] == ["optim.lr"]
    with pytest.raises(CheckpointMismatch) as err:
        plan.check()
    text = str(err.value)
    assert "(data.max_bytes: 4000000 -> 9000 changes the training samples, which the saved sample " \
           "cursor counts through; model.n_embd: 128 -> 256 changes the model, which the saved " \
           "weights fit)" in text, text
    assert "num_workers" not in text and "pin_memory" not in text and "compile" not in text


def test_two_rank_job_refuses_and_completes_in_the_launching_process(tmp_path):
    """At 2 ranks the check runs before torchrun: one error line (no per-rank copies, no
    'rank failed' line), and a finished run starts no worker."""
    out = tmp_path / "run"
    flags = [*[f for f in SMALL if not f.startswith("--parallel.nproc")], "--parallel.nproc=2",
             "--train.steps=2", f"--train.out_dir={out}"]
    first = run_disttrain(["train", "examples/tiny_gpt.toml", *flags], timeout=240)
    assert first.returncode == 0, first.stderr[-2000:]
    refused = run_disttrain(["train", "examples/tiny_gpt.toml", *flags, "--model.n_embd=64"], timeout=120)
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "model.n_embd: 32 -> 64" in errors[0], refused.stderr[-2000:]
    again = run_disttrain(["train", "examples/tiny_gpt.toml", *flags], timeout=120)
    assert again.returncode == 0 and "complete at step 2" in again.stdout
    assert "torch.distributed.run" not in again.stderr and "[rank" not in again.stderr
