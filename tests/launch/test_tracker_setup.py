"""The trackers' set-up (train/tracker_checks.py, train/trackers.py): every failure that
would stop a tracker (no W&B key, no way to the server, a store MLflow refuses) is one
line before the ranks train; `log.wandb_mode`; a resumed W&B run is sent only the steps
its server does not hold; the trackers get the run's whole config and the script's own
values (`job.log_config`). No network: closed local ports stand for unreachable servers."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import run_disttrain, worker_env
from torch.utils.data import TensorDataset

import disttrain as dt
from disttrain.config import load_config
from disttrain.errors import ConfigError, UserError

CLOSED = "http://127.0.0.1:1"  # nothing listens on port 1: "Connection refused" at once


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No W&B key anywhere W&B looks (the environment, the netrc file) and no MLflow opt-in."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL",
                 "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return tmp_path


@pytest.mark.parametrize("env, tracker, message", [
    ({}, dt.WandbTracker(), r"W&B in online mode has no API key for api\.wandb\.ai: set WANDB_API_KEY or run "
                            r"`wandb login` once, or log offline \(dt\.WandbTracker\(mode=\"offline\"\)"),
    ({"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": CLOSED}, dt.WandbTracker(),
     r"W&B in online mode cannot reach http://127\.0\.0\.1:1 \(Connection refused\)"),
    ({}, dt.MlflowTracker(tracking_uri="file:///tmp/mlruns"),
     r"MLflow 3 refuses the file store file:///tmp/mlruns unless MLFLOW_ALLOW_FILE_STORE=true"),
    ({}, dt.MlflowTracker(tracking_uri=CLOSED),
     r"MLflow cannot reach the tracking server http://127\.0\.0\.1:1 \(Connection refused\)"),
])
def test_a_tracker_that_cannot_start_is_one_user_error_when_the_job_is_built(
        no_credentials, monkeypatch, env, tracker, message):
    pytest.importorskip("mlflow")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=message) as caught:
        dt.Job(no_credentials, trackers=tracker)
    assert "\n" not in str(caught.value)


def test_trackers_that_can_start_pass_the_checks(no_credentials, monkeypatch):
    pytest.importorskip("mlflow")
    dt.Job(no_credentials, trackers=[dt.WandbTracker(mode="offline"), dt.WandbTracker(mode="disabled")])
    netrc = no_credentials / "netrc"
    netrc.write_text("machine 127.0.0.1\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_BASE_URL", CLOSED)
    # the key `wandb login` wrote is found: what is left is the server, unreachable here
    with pytest.raises(UserError, match="cannot reach"):
        dt.Job(no_credentials, trackers="wandb")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    dt.Job(no_credentials, trackers=dt.MlflowTracker(tracking_uri=(no_credentials / "ml").as_uri()))


def test_log_wandb_mode_is_validated_and_reaches_the_tracker(tmp_path):
    from disttrain.train.trackers import WandbTracker, from_config

    cfg = load_config(None, ["--log.wandb=proj", "--log.wandb_mode=offline"])
    assert from_config(cfg.log) == [WandbTracker(project="proj", mode="offline")]
    with pytest.raises(ConfigError, match=r"'log.wandb_mode' is 'off'; choose one of online, offline, disabled"):
        load_config(None, ["--log.wandb=proj", "--log.wandb_mode=off"])


def test_disttrain_train_refuses_a_wandb_run_without_a_key_before_any_rank_starts(no_credentials):
    env = worker_env(NETRC=str(no_credentials / "no-netrc"))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        env.pop(name, None)
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", f"--train.out_dir={no_credentials / 'run'}",
                          "--log.wandb=proj"], timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'disttrain train: error: W&B in online mode has no API key for api.wandb.ai: set WANDB_API_KEY or run '
        '`wandb login` once, or log offline (log.wandb_mode = "offline" or WANDB_MODE=offline; `wandb sync` '
        'uploads it later).']
    assert not (no_credentials / "run").exists()


@pytest.mark.timeout(120)
def test_a_job_scripts_tracker_failure_under_disttrain_run_is_one_line_exit_2(no_credentials):
    script = no_credentials / "job.py"
    script.write_text("import sys, disttrain as dt\n"
                      "with dt.Job(sys.argv[1], trackers='wandb') as job:\n"
                      "    raise SystemExit('not reached: the job is refused when it is built')\n")
    env = worker_env(NETRC=str(no_credentials / "no-netrc"))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        env.pop(name, None)
    proc = run_disttrain(["run", "--nproc", "2", "--max-restarts", "2", str(script), str(no_credentials / "o")],
                         timeout=100, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "not reached" not in out and "closing signal" not in out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [
        line for line in errors if line.startswith("disttrain job: error: W&B in online mode has no API key")
    ]
    assert len(errors) == 1


class _FakeWandbRun:
    """What `wandb.init` returns for a resumed run whose server holds steps 1-6."""

    def __init__(self, **kwargs):
        self.id, self.resumed, self.starting_step = kwargs["id"], True, 7
        self.config = self.summary = types.SimpleNamespace(update=lambda *a, **k: None)
        self.logged: list[int] = []

    def log(self, values, step):
        self.logged.append(step)


def test_a_resumed_wandb_run_is_sent_only_the_steps_its_server_lacks(tmp_path, monkeypatch):
    """The killed attempt's W&B process sent steps 1-6 before the kill; trackers.json says
    only 0 (the mark is written when W&B finishes). The new attempt resumes at checkpoint
    step 4 and trains 5-8: W&B gets 7 and 8, nothing twice."""
    from disttrain.train.trackers import Trackers, WandbTracker

    runs: list[_FakeWandbRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1]  # type: ignore[attr-defined]
    fake.Settings = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {s}.0}}\n' for s in range(1, 7)))
    trackers = Trackers([WandbTracker(mode="online")], tmp_path / "ckpt", tmp_path, {"a": 1})
    trackers.begin(["start", "restart"], 4)
    for step in range(5, 9):
        trackers.log({"step": step, "loss": float(step)})
    assert runs[0].logged == [7, 8]


def test_the_trackers_get_the_whole_config_and_the_scripts_own_values(tmp_path, monkeypatch):
    """A one-process Job with an MLflow file store: its params hold the job's sections,
    the optimizer's real learning rate and what `job.log_config` added (before the
    loop, and during it)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    with dt.Job(tmp_path, trackers=dt.MlflowTracker(experiment="cfg", tracking_uri=uri), progress=False,
                tensorboard=False) as job:
        model = job.wrap(torch.nn.Linear(2, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.025)
        loader = job.loader(TensorDataset(torch.randn(32, 2)), batch_size=4)
        job.log_config({"dataset": "toy", "width": 2})
        with pytest.raises(UserError, match="optim is a section of the job's own config"):
            job.log_config({"optim": "sgd"})
        job.resume(model=model, optimizer=opt)
        for (x,) in job.steps(loader, max_steps=2):
            job.backward(model(x).pow(2).mean())
            job.log(loss=1.0)
            job.log_config({"during": True})
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cfg").experiment_id])
    params = run.data.params
    assert params["optim.lr"] == "0.025" and params["optim.optimizer"] == "SGD"
    assert params["train.seed"] == "1337" and params["parallel.strategy"] == "ddp"
    assert params["checkpoint.every"] == "0" and params["job.strategy"] == "ddp"
    assert params["dataset"] == "toy" and params["width"] == "2" and params["during"] == "True"
    assert "train.steps" not in params and "model.n_layer" not in params  # disttrain train's, not this job's
