"""Experiment trackers (train/trackers.py) for real: a dt.Job script under `disttrain
run` sends its run to W&B in offline mode and to an MLflow file store; it is killed -9
mid-run, restarted, then resumed at another world size. The files both wrote are read
back: one W&B run id and one MLflow run, every step once, the restarts and the world-size
change recorded. The config route: `disttrain train` with `[log] wandb` / `[log] mlflow`,
and under `[elastic] fast_recovery` with two ranks killed. No network: W&B
offline, MLflow on files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import WORKERS, run_disttrain, worker_env

from disttrain.config import load_config
from disttrain.errors import ConfigError, UserError

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true"}


def _launch(out: Path, nproc: int, steps: int, fault: str = "") -> str:
    env = worker_env(**ENV, **({"DISTTRAIN_FAULT": fault} if fault else {}))
    proc = run_disttrain(["run", "--nproc", str(nproc), "--max-restarts", "1", str(WORKERS / "tracker_job.py"),
                          str(out), str(steps)], timeout=240, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _wandb_records(path: Path):
    """The protobuf records of one offline .wandb file: a 7-byte W&B header, then a
    LevelDB-style log of 32 KiB blocks, each chunk behind (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left  # the rest of a block is padding
            continue
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = body if kind in (1, 2) else parts + body  # full / first, else middle / last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_history(out: Path) -> tuple[set[str], list[dict], list[str]]:
    """(run ids, history rows, run/events) of every offline run under out/wandb."""
    ids, rows, events = set(), [], []
    for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "summary":
                for item in rec.summary.update:
                    if (item.key or "/".join(item.nested_key)) == "run/events":
                        events = json.loads(item.value_json)
    return ids, rows, events


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_restart_and_resize_leave_one_tracker_run_with_every_step_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a file store
    log = _launch(tmp_path, 2, 12, fault="kill@backward:rank=1,step=7")
    assert "disttrain fault: kill" in log and "resumed at step 4" in log, log[-3000:]
    _launch(tmp_path, 1, 16)  # the same run, resumed at world size 1
    kept = json.loads((tmp_path / "checkpoints" / "trackers.json").read_text())
    assert kept["wandb"]["step"] == kept["mlflow"]["step"] == 16

    ids, rows, events = _wandb_history(tmp_path)
    assert ids == {kept["wandb"]["id"]}  # three attempts, one W&B run
    steps = [r["_step"] for r in rows if "loss" in r]
    assert sorted(steps) == list(range(1, 17))  # steps 5-7 trained twice, sent once
    assert {r["_step"]: r["world_size"] for r in rows}[16] == 1
    assert len(events) == 3 and "world size 2 -> 1" in events[2], events

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("tracker-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [kept["mlflow"]["id"]]
    run = runs[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 17))
    assert run.data.params["job.strategy"] == "ddp" and run.info.status == "FINISHED"
    attempts = {k: v for k, v in run.data.tags.items() if k.startswith("disttrain.attempt.")}
    assert len(attempts) == 3 and "world size 2 -> 1" in attempts["disttrain.attempt.2"]
    # both trackers hold the same value at each step (W&B's steps 1-4 were sent again from
    # metrics.jsonl: its killed process lost them)
    wb = {r["_step"]: r["loss"] for r in rows if "loss" in r}
    ml = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert wb == pytest.approx(ml)
    # the summary, the report and both trackers give the same final loss
    from disttrain.report.report_command import report

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_train_loss"] == pytest.approx(wb[16]) == pytest.approx(run.data.metrics["loss"])
    assert dict(report(tmp_path)["table"])["final train loss"] == f"{wb[16]:.3f}"


def test_log_section_names_the_trackers(tmp_path):
    from disttrain.train.trackers import MlflowTracker, WandbTracker, from_config

    path = tmp_path / "c.toml"
    path.write_text('[log]\nwandb = "proj"\nwandb_entity = "team"\nmlflow = "exp"\n'
                    'mlflow_tracking_uri = "file:///tmp/x"\n')
    assert from_config(load_config(path).log) == [WandbTracker(project="proj", entity="team"),
                                                  MlflowTracker(experiment="exp", tracking_uri="file:///tmp/x")]
    assert from_config(load_config(None).log) == []


def test_a_tracker_is_checked_before_any_rank_starts(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    path = tmp_path / "c.toml"
    path.write_text('[log]\nmlflow = "exp"\n')
    with pytest.raises(ConfigError, match=r"'log.mlflow' is set but the mlflow package is not installed: "
                                          r"pip install 'disttrain\[mlflow\]'"):
        load_config(path)
    import disttrain as dt

    with pytest.raises(UserError, match=r"pip install 'disttrain\[mlflow\]'"):
        dt.Job(tmp_path, trackers="mlflow")
    with pytest.raises(UserError, match="is not a tracker"):
        dt.Job(tmp_path, trackers=["tensorboard"])


def test_disttrain_train_sends_its_run_to_both_trackers(tmp_path, monkeypatch):
    """The config route: `[log] wandb` and `[log] mlflow` on a one-process `disttrain train`
    open both tracker runs. (A second command continuing them goes through the same
    `open_trackers` as the dt.Job script's: the kill -9 and resize test above.)"""
    from elastic_helpers import TINY

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").resolve().as_uri()
    args = ["train", "examples/tiny_gpt.toml", *TINY, "--parallel.nproc=1", f"--train.out_dir={tmp_path}",
            "--log.wandb=cfg-test", "--log.mlflow=cfg-test", f"--log.mlflow_tracking_uri={uri}",
            "--log.tensorboard=false"]
    proc = run_disttrain([*args, "--train.steps=5"], timeout=180, env=worker_env(**ENV))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cfg-test").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4, 5]
    assert run.data.params["train.batch_size"] == "4" and run.data.params["model.n_layer"] == "1"
    ids, rows, _ = _wandb_history(tmp_path)
    assert len(ids) == 1 and sorted(r["_step"] for r in rows if "loss" in r) == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fast_recovery_keeps_one_tracker_run_with_every_step_once(tmp_path, monkeypatch):
    """`[elastic] fast_recovery`: rank 0 is killed (a spare takes over in a new process,
    which opens the tracker runs again), then rank 1 (rank 0's process, and its W&B
    buffer, live on). One W&B run and one MLflow run, every step once."""
    from elastic_helpers import start, trainer_cmd

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").resolve().as_uri()
    cmd = trainer_cmd(tmp_path, "--train.steps=16", "--elastic.fast_recovery=true", "--checkpoint.every=3",
                      "--log.wandb=fr", "--log.mlflow=fr", f"--log.mlflow_tracking_uri={uri}",
                      "--log.tensorboard=false")
    faults = "kill@backward:rank=0,step=8,restart=0;kill@backward:rank=1,step=12,restart=1"
    proc = start(cmd, tmp_path / "log.txt", DISTTRAIN_FAULT=faults, **ENV)
    assert proc.wait(timeout=300) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    assert (tmp_path / "log.txt").read_text().count("its warm spare took over") == 2
    ids, rows, events = _wandb_history(tmp_path)
    assert len(ids) == 1 and sorted(r["_step"] for r in rows if "loss" in r) == list(range(1, 17))
    assert len(events) == 3
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fr").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 17))
