"""`dt.Job` (disttrain/train/job.py): examples/plain_to_disttrain.py under `disttrain run`
killed -9 mid-run resumes to bit-identical weights with every sample once; SIGTERM
saves and exits 0; each misuse is one `UserError`."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ROOT, WORKERS, built_once, run_disttrain, worker_env
from torch.utils.data import TensorDataset

import disttrain as dt
from disttrain.builtin import MLP, MLPConfig
from disttrain.elastic import final_timeline
from disttrain.errors import UserError

EXAMPLE = "examples/plain_to_disttrain.py"
STEPS = 16  # one epoch: 2048 samples / (32 x 2 ranks x accum 2)
N = 2048


def launch(out, *extra: str, fault: str | None = None, steps: int = STEPS):
    env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
    return run_disttrain(["run", "--nproc", "2", "--max-restarts", "3", EXAMPLE, "--out", str(out),
                          "--steps", str(steps), *extra], timeout=150, env=env)


def ok(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def weights(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def run(out):
        ok(launch(out))
        return weights(out)

    return built_once(tmp_path_factory, "job-ref", run)


def test_kill_9_resumes_bit_exactly_each_sample_once(reference, tmp_path):
    log = ok(launch(tmp_path, "--record-samples", fault="kill@backward:rank=1,step=13"))
    assert "disttrain fault: kill" in log
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:4000]  # the trace goes to the log
    assert "rank 0 lost a peer at step 13" in log, log[-4000:]  # one line
    assert "resumed at step 10" in log  # the newest checkpoint before the kill
    got = weights(tmp_path)
    assert got.keys() == reference.keys()
    for k in got:
        assert torch.equal(got[k], reference[k]), f"{k} differs from the uninterrupted run"
    records = [json.loads(line) for f in sorted((tmp_path / "samples").glob("*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    assert len({r["generation"] for r in records}) == 2  # two attempts were audited
    timeline = final_timeline(records)
    assert sorted(timeline) == list(range(1, STEPS + 1))
    assert sorted(i for idx in timeline.values() for i in idx) == list(range(N))


def test_sigterm_saves_exits_zero_then_resumes(reference, tmp_path):
    log = ok(launch(tmp_path, fault="term@step:rank=0,step=5"))
    # every rank stops where the next vote is read: the signal's step or a later one
    stopped = int(re.search(r"preempted \(SIGTERM\); saved step (\d+)", log).group(1))
    assert 5 <= stopped < STEPS
    assert (tmp_path / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert not (tmp_path / "model.pt").exists()  # code after the loop did not run
    log = ok(launch(tmp_path))
    assert f"resumed at step {stopped}" in log
    got = weights(tmp_path)
    assert all(torch.equal(got[k], reference[k]) for k in reference)


@pytest.mark.parametrize(("strategy", "where"), [("ddp", "before"), ("fsdp", "inside")])  # each once
def test_optimizer_before_wrap_is_one_line_exit_2_and_never_retried(tmp_path, strategy, where):
    """Under every strategy (DDP keeps the parameters, so the mistake used to pass), and
    with restarts on: one line from the launcher, no traceback, no second start. Built
    before `with dt.Job(...)` too, where the `gc.freeze()` at init hid the optimizer
    from the collector's scan that the check once was, and DDP accepted it in silence."""
    proc = run_disttrain(["run", "--nproc", "2", "--max-restarts", "3", str(WORKERS / "job_misuse.py"),
                          str(tmp_path), strategy, where], timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("the optimizer was built before job.wrap()") == 1, out[-3000:]
    assert "Traceback" not in out
    assert sorted((tmp_path / "starts").read_text().split("\n")[:-1]) == ["0 0", "1 0"]  # no restart


# ---------------------------------------------------------------- in one process (a world of 1)

def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g))


def setup(job, *, resume: bool = True):
    model = job.wrap(MLP(MLPConfig()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = job.loader(data(), batch_size=8)
    if resume:
        job.resume(model=model, optimizer=optimizer)
    return model, optimizer, loader


def test_complete_job_yields_no_steps(tmp_path, capsys):
    for _ in range(2):
        with dt.Job(tmp_path, checkpoint_every=0) as job:
            model, _, loader = setup(job)
            seen = [job.backward(model(x, y)[1]) for x, y in job.steps(loader, max_steps=3)]
    assert seen == []
    captured = capsys.readouterr()
    assert job.step == 3 and "complete" in captured.out + captured.err
    assert (tmp_path / "model.pt").exists()


def test_optimizer_built_before_the_job_is_refused_whatever_the_collector_froze(tmp_path):
    """The check holds without the collector: the optimizer below is frozen out of
    `gc.get_objects()` before the job starts, and is still found to predate the wrap; one
    built after the wrap is taken."""
    import gc

    raw = MLP(MLPConfig())
    early = torch.optim.SGD(raw.parameters(), lr=0.1)
    gc.freeze()
    try:
        with dt.Job(tmp_path, checkpoint_every=0) as job:
            model = job.wrap(raw)
            job.loader(data(), batch_size=8)
            with pytest.raises(dt.UserError, match="the optimizer was built before job.wrap"):
                job.resume(model=model, optimizer=early)
            assert job.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) is False
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("mistake, message", [
    ("steps_before_resume", "call job.resume"),
    ("backward_outside", "inside `for batch in job.steps"),
    ("foreign_loader", "takes the loader job.loader() returned"),
    ("unwrapped_model", "must be the module job.wrap() returned"),
    ("wrap_twice", "called once per job"),
    ("no_backward", "needs one job.backward(loss)"),
    ("backward_twice", "already called for this batch"),
    ("own_sampler", "are the job's"),
    ("outside_with", "outside its `with dt.Job"),
])
def test_misuse_is_one_user_error(tmp_path, mistake, message):
    with pytest.raises(dt.UserError, ) as err:
        if mistake == "outside_with":
            dt.Job(tmp_path).wrap(MLP(MLPConfig()))
        with dt.Job(tmp_path) as job:
            if mistake == "unwrapped_model":
                job.wrap(MLP(MLPConfig()))
                job.loader(data(), batch_size=8)
                raw = MLP(MLPConfig())
                job.resume(model=raw, optimizer=torch.optim.AdamW(raw.parameters()))
            if mistake == "wrap_twice":
                job.wrap(MLP(MLPConfig()))
                job.wrap(MLP(MLPConfig()))
            if mistake == "own_sampler":
                job.loader(data(), batch_size=8, sampler=None)
            model, _, loader = setup(job, resume=mistake != "steps_before_resume")
            if mistake == "backward_outside":
                job.backward(model(*data()[:8])[1])
            if mistake == "foreign_loader":
                loader = torch.utils.data.DataLoader(data(), batch_size=8)
            for x, y in job.steps(loader, max_steps=2):
                if mistake != "no_backward":
                    job.backward(model(x, y)[1])
                if mistake == "backward_twice":
                    job.backward(model(x, y)[1])
    assert message in str(err.value)


def test_elastic_sampler_takes_a_dataset():
    assert len(dt.ElasticSampler(data(), batch_size=8, rank=0, world_size=1)) == 64
    with pytest.raises(dt.UserError, match="len"):
        dt.ElasticSampler(iter([1, 2]), batch_size=8, rank=0, world_size=1)


def test_job_conversion_changes_no_more_lines_than_accelerate(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.code_diff import count_all

    counts = count_all({"job": "disttrain_job.py", "accelerate": "accelerate_run.py"})
    assert counts["job"]["changed"] <= counts["accelerate"]["changed"], counts["job"]["diff"]


def _trained(out, max_steps: int, accum: int, leave_after: int | None, how: str = "break"):
    """(model weights, job.step, any gradient left) after a loop of `max_steps` whose script
    leaves it right after the backward of batch `leave_after` (1-based), by `how`."""
    with dt.Job(out, checkpoint_every=0, accum_steps=accum) as job:
        model, _, loader = setup(job)

        def loop():
            for i, (x, y) in enumerate(job.steps(loader, max_steps=max_steps), 1):
                job.backward(model(x, y)[1])
                if i == leave_after:
                    if how == "raise":
                        raise KeyboardInterrupt
                    return

        try:
            loop()
        except KeyboardInterrupt:
            pass
        left = any(p.grad is not None for p in model.parameters())
        return {k: v.clone() for k, v in model.state_dict().items()}, job.step, left


@pytest.mark.parametrize("accum, how", [(1, "break"), (2, "break"), (2, "raise")])
def test_leaving_the_loop_after_the_stepping_backward_keeps_that_step(tmp_path, accum, how):
    """As `loss.backward(); opt.step(); break` does in plain PyTorch: the backward that
    closes an accumulation window steps the optimizer then and there, so a script that
    leaves the loop right after it (at step 5) holds the weights of a loop that ran 5
    steps to its end, and `job.step` says 5."""
    full, full_step, _ = _trained(tmp_path / "full", 5, accum, None)
    left, left_step, grads_left = _trained(tmp_path / "left", 10, accum, 5 * accum, how)
    assert full_step == left_step == 5
    assert not grads_left  # zeroed by the step, not left in .grad
    assert all(torch.equal(full[k], left[k]) for k in full)


def test_a_failure_after_the_stepping_backward_is_reported_at_that_step(tmp_path):
    """The step a failure names (`job.step_in_flight`; fast recovery's likewise) is
    the one its batch belongs to, also once the loop is left by the exception after the
    backward that stepped the optimizer (the report said step 6 for an error in step 5's
    batch)."""
    seen = []
    with dt.Job(tmp_path, checkpoint_every=0, accum_steps=2) as job:
        model, _, loader = setup(job)
        with pytest.raises(KeyboardInterrupt):
            for x, y in job.steps(loader, max_steps=3):
                before = job.step_in_flight
                job.backward(model(x, y)[1])
                seen.append((before, job.step_in_flight))
                if len(seen) == 4:  # the closing batch of step 2
                    raise KeyboardInterrupt
        assert job.step == 2 and job.step_in_flight == 2
    assert seen == [(1, 1), (1, 1), (2, 2), (2, 2)]


def test_an_unknown_keyword_is_pythons_own_type_error(tmp_path):
    with pytest.raises(TypeError, match="checkpont_every"):
        dt.Job(tmp_path, checkpont_every=5)


def _fields(obj, prefix=""):
    """Every leaf setting of a config dataclass, as {dotted key: value}."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def test_a_job_without_a_config_runs_with_the_configs_own_defaults(tmp_path):
    """One set of defaults whichever way a Job is made: `dt.Job(out)` and
    `dt.Job(out, Config())` had different seeds, clipping, log and checkpoint periods."""
    from disttrain.config import Config

    plain, given = _fields(dt.Job(tmp_path).cfg), _fields(dt.Job(tmp_path, Config()).cfg)
    assert plain.keys() == given.keys()
    assert {k: (v, given[k]) for k, v in plain.items() if v != given[k]} == {}
    keyword = dt.Job(tmp_path, seed=7, grad_clip=0.5, checkpoint_every=4)  # a keyword sets its field only
    assert {k for k, v in _fields(keyword.cfg).items() if v != given[k]} == {
        "train.seed", "optim.grad_clip", "checkpoint.every"}


def test_the_config_object_is_taken_whole_and_a_short_keyword_overrides_it(tmp_path):
    """A given Config's fields are used, a short keyword wins over its field, and the
    caller's Config is not changed."""
    from disttrain.config import CheckpointConfig, Config, ElasticConfig, TrainConfig

    config = Config(train=TrainConfig(seed=5, log_every=3), elastic=ElasticConfig(batch_policy="rescale_lr"),
                    checkpoint=CheckpointConfig(every=3, keep_last=7, dir=str(tmp_path / "ck")))
    job = dt.Job(tmp_path / "out", config, checkpoint_every=9, strategy="fsdp")
    assert (job.cfg.train.seed, job.cfg.train.log_every, job.cfg.checkpoint.keep_last) == (5, 3, 7)
    assert (job.cfg.checkpoint.every, job.strategy, job.cfg.elastic.batch_policy) == (9, "fsdp", "rescale_lr")
    assert job.checkpoint_dir == tmp_path / "ck" and config.checkpoint.every == 3
    with pytest.raises(UserError, match="takes a disttrain.config.Config"):
        dt.Job(tmp_path, {"train": {}})
