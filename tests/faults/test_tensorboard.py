"""TensorBoard event files of `disttrain train` and `dt.Job.log`, read back with
tensorboard's own reader, and `disttrain report` on the same real run: two ranks, rank 1
killed -9 at step 5, the same command resumed on one rank from the step-3 checkpoint."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from conftest import built_once, run_disttrain, worker_env
from elastic_helpers import TINY, metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS, CKPT_EVERY, KILL_AT = 10, 3, 5
TRAIN = ["train", "examples/tiny_gpt.toml", *TINY, f"--train.steps={STEPS}",
         f"--checkpoint.every={CKPT_EVERY}", "--train.eval_every=4"]


def ok(proc) -> str:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def events(out) -> EventAccumulator:
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def texts(acc: EventAccumulator, tag: str = "run/events/text_summary") -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


@pytest.fixture(scope="module")
def killed_and_shrunk(tmp_path_factory):
    def run(out):
        first = run_disttrain([*TRAIN, f"--train.out_dir={out}", "--max-restarts", "0"], timeout=180,
                              env=worker_env(DISTTRAIN_FAULT=f"kill@step:rank=1,step={KILL_AT}"))
        assert first.returncode != 0 and "disttrain fault: kill" in first.stdout + first.stderr
        log = ok(run_disttrain([*TRAIN, f"--train.out_dir={out}", "--parallel.nproc=1"], timeout=180))
        assert f"resumed at step {CKPT_EVERY}" in log
        return out

    return built_once(tmp_path_factory, "tensorboard-run", run)


def test_event_files_hold_every_metric_and_the_restart(killed_and_shrunk):
    acc = events(killed_and_shrunk)
    for tag in ("loss/train", "optim/lr", "optim/grad_norm", "throughput/tokens_per_s",
                "step_time/slowest_rank_s", "step_time/fastest_rank_s", "memory/peak_mb_rank0"):
        assert sorted(scalars(acc, tag)) == list(range(1, STEPS + 1)), tag
    assert sorted(scalars(acc, "loss/heldout")) == [4, 8, STEPS]
    # Rank 1 lived only in the first attempt; purge_step hid what it logged after step 3.
    assert sorted(scalars(acc, "memory/peak_mb_rank1")) == list(range(1, CKPT_EVERY + 1))
    assert scalars(acc, "run/attempt") == {0: 0.0, CKPT_EVERY: 1.0}
    world = scalars(acc, "run/world_size")
    assert world[0] == 2 and world[CKPT_EVERY] == 1 and world[STEPS] == 1
    slow, fast = scalars(acc, "step_time/slowest_rank_s"), scalars(acc, "step_time/fastest_rank_s")
    assert all(slow[s] >= fast[s] > 0 for s in slow)
    notes = texts(acc)
    assert set(notes) == {0, CKPT_EVERY}
    assert "restart (attempt 1): resumed at step 3, world size 2 -> 1" in notes[CKPT_EVERY]
    # The same numbers as metrics.jsonl: the resumed attempt's record of each step wins.
    final = {m["step"]: m for m in metrics(killed_and_shrunk)}
    assert scalars(acc, "loss/train")[STEPS] == pytest.approx(final[STEPS]["loss"])
    assert len(final[2]["step_time_s"]) == 2 and len(final[STEPS]["peak_mem_mb"]) == 1


def test_run_events_name_each_attempt(killed_and_shrunk):
    lines = [json.loads(x) for x in (killed_and_shrunk / "run_events.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["step"], e["resumed"], e["world_size"], e["prev_world_size"])
            for e in lines] == [(0, 0, False, 2, None), (1, CKPT_EVERY, True, 1, 2)]


def test_report_marks_the_kill_and_the_new_world_size(killed_and_shrunk, tmp_path):
    png = tmp_path / "r.png"
    proc = ok(run_disttrain(["report", str(killed_and_shrunk), "--out", str(png)], timeout=120))
    assert "attempts / restarts" in proc and "2 / 1" in proc
    side = json.loads(png.with_suffix(".json").read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and side["steps"] == STEPS
    assert [(m["step"], m["kind"]) for m in side["marks"]] == [(CKPT_EVERY, "restart"),
                                                               (CKPT_EVERY, "world_size")]
    assert side["marks"][1]["label"] == "world size 2 -> 1"


def test_tensorboard_false_writes_no_event_files(tmp_path):
    ok(run_disttrain(["train", "examples/tiny_gpt.toml", *TINY, "--train.steps=2", "--parallel.nproc=1",
                      "--log.tensorboard=false", f"--train.out_dir={tmp_path}"], timeout=120))
    assert not (tmp_path / "tb").exists()
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2] and (tmp_path / "run_events.jsonl").exists()


JOB = textwrap.dedent('''
    import sys
    import torch
    import disttrain as dt
    from disttrain.builtin import MLP, MLPConfig
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x[:, :4])
    with dt.Job(sys.argv[1], accum_steps=2, checkpoint_every=0, grad_clip=1.0) as job:
        loader = job.loader(data, batch_size=16)
        model = job.wrap(MLP(MLPConfig()))
        job.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
        for xb, yb in job.steps(loader, max_steps=4):
            _, loss = model(xb, yb)
            job.backward(loss)
            job.log(loss=loss, rank=dt.rank_info().rank)
''')


def test_job_log_is_one_call(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out"
    ok(run_disttrain(["run", "--nproc", "2", str(script), str(out)], timeout=150))
    acc = events(out)
    assert sorted(scalars(acc, "loss/train")) == [1, 2, 3, 4]
    assert scalars(acc, "optim/lr")[4] == pytest.approx(0.05)
    assert scalars(acc, "train/rank") == {s: 0.5 for s in range(1, 5)}  # averaged over ranks 0, 1
    for tag in ("optim/grad_norm", "throughput/samples_per_s", "memory/peak_mb_rank1"):
        assert sorted(scalars(acc, tag)) == [1, 2, 3, 4], tag
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["world_size"] == 2


def test_missing_tensorboard_is_one_clear_error(tmp_path, monkeypatch):
    from disttrain.errors import UserError
    from disttrain.runtime import RankInfo
    from disttrain.train.run_log import RunLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    info = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                    backend="gloo", seed=0)
    with pytest.raises(UserError, match=r"pip install tensorboard.*\[log\] tensorboard = false"):
        RunLog(tmp_path, info, 0, False, tensorboard=True)
    assert RunLog(tmp_path, info, 0, False, tensorboard=False).writer is None


def test_job_log_misuse_is_one_user_error(tmp_path):
    import disttrain as dt
    from disttrain.builtin import MLP, MLPConfig
    from disttrain.errors import UserError

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    with dt.Job(tmp_path, checkpoint_every=0, tensorboard=False) as job:
        loader = job.loader(torch.utils.data.TensorDataset(x, x[:, :4]), batch_size=16)
        model = job.wrap(MLP(MLPConfig()))
        job.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(UserError, match=r"inside `for batch in job.steps"):
            job.log(loss=1.0)
        for xb, yb in job.steps(loader, max_steps=1):
            _, loss = model(xb, yb)
            job.backward(loss)
            with pytest.raises(UserError, match=r"dt.Job.log\(hist=...\) got Tensor; pass a number"):
                job.log(hist=torch.ones(3))
            job.log(loss=loss)
    assert [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [1]
    assert not (tmp_path / "tb").exists()
