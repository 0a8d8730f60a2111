"""Bring your own model and data (train/model_data_loss.py): `disttrain train tests/byo/byo.toml`
trains a model and a dataset of the user's own (tests/byo/: an MLP regressor with
dropout on dict batches, a generated (train, eval) pair), with ddp and fsdp at 2 ranks,
survives a kill -9 mid-run with the automatic restart, and ends bit-identical to an
uninterrupted run with every sample of the epoch consumed exactly once. Each user
mistake is one clear error naming the key and the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_disttrain, worker_env
from elastic_helpers import audit_timeline, last_loss_per_step, load_params

from disttrain.config import load_config
from disttrain.errors import ConfigError, UserError
from disttrain.train.batches import batch_loss
from disttrain.train.model_data_loss import build_datasets, build_loss, build_model

BYO = ROOT / "tests" / "byo"
TOML = "tests/byo/byo.toml"
KILL = "kill@backward:rank=1,step=5"


def _train(out: Path, strategy: str, fault: str = "") -> str:
    args = ["run", "--nproc", "2", *(["--max-restarts", "1"] if fault else []), "-m", "disttrain.train",
            TOML, f"--parallel.strategy={strategy}", f"--train.out_dir={out}"]
    env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
    proc = run_disttrain(args, timeout=120, env=env)
    assert proc.returncode == 0, f"{strategy} {fault}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_own_model_and_data_resume_bit_exactly_after_kill_9(tmp_path, strategy):
    ref, got = tmp_path / "reference", tmp_path / "killed"
    _train(ref, strategy)
    log = _train(got, strategy, KILL)
    assert log.count("disttrain fault: kill") == 1, log[-3000:]
    assert "resumed at step 4" in log, log[-3000:]  # checkpoint.every = 1; killed in step 5
    a, b = load_params(ref / "model.pt"), load_params(got / "model.pt")
    assert a.keys() == b.keys() and set(a) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias",
                                               "net.6.weight", "net.6.bias"}
    for k in a:
        assert torch.equal(a[k], b[k]), f"{strategy}: {k} differs from the uninterrupted run"
    assert last_loss_per_step(got) == last_loss_per_step(ref)  # per-step losses, bit for bit
    # The sample audit: 8 steps of 2 ranks x 4 = one epoch of 64, each sample exactly once.
    for out in (ref, got):
        timeline = audit_timeline(out)
        assert sorted(timeline) == list(range(1, 9))
        assert all(len(v) == 8 for v in timeline.values())
        assert sorted(i for v in timeline.values() for i in v) == list(range(64))
    assert audit_timeline(got) == audit_timeline(ref)
    import json
    summary = json.loads((got / "summary.json").read_text())
    assert summary["resumed"] and summary["final_heldout_loss"] == summary["final_heldout_loss"]  # not NaN


def _cfg(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    ('[model]\nfactory = "byo_models.build"\n',
     "'model.factory' is 'byo_models.build'; write it as \"module:callable\""),
    ('[data]\nfactory = "no colon"\n', "'data.factory'"),
    ('[train]\nloss = ":fn"\n', "'train.loss'"),
    ('[model]\nfactory = "m:f"\nn_layer = 2\n',
     "'model.factory' ('m:f') is set together with the built-in GPT's key(s) model.n_layer"),
    ('[model]\nfactory = "m:f"\nhf = "gpt2"\n', "'model.factory' and 'model.hf' are both set"),
    ('[model.kwargs]\nwidth = 3\n', "'model.kwargs' is set but 'model.factory' is not"),
    ('[model]\nfactory = "m:f"\n[model.kwargs]\nwhen = 1979-05-27\n', "'model.kwargs.when'"),
])
def test_config_form_errors_in_load_config(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(tmp_path, text))
    assert needle in str(e.value)


def test_existing_tomls_and_gpt_keys_still_load():
    cfg = load_config(ROOT / "examples" / "tiny_gpt.toml", ["--model.n_layer=2"])
    assert cfg.model.n_layer == 2 and cfg.model.factory == "" and cfg.model.kwargs == {}
    cfg = load_config(BYO / "byo.toml", ["--model.kwargs.width=16"])
    assert cfg.model.kwargs["width"] == 16  # a dotted override reaches into kwargs


@pytest.mark.parametrize("override, needle", [
    ("--model.factory=byo_nowhere:build", "'model.factory' = 'byo_nowhere:build': cannot import module 'byo_nowhere'"),
    ("--model.factory=byo_models:not_callable", "'not_callable' in module 'byo_models' is a int, not callable"),
    ("--data.factory=byo_data:missing", "module 'byo_data' has no attribute 'missing'"),
])
def test_import_errors_before_any_process_starts(tmp_path, override, needle):
    """Raised by `disttrain train` in the launching process: one line, exit 2, no torchrun."""
    proc = run_disttrain(["train", TOML, override, f"--train.out_dir={tmp_path}"], timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "torchrun" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


def _config(*overrides: str):
    return load_config(BYO / "byo.toml", list(overrides))


def test_wrong_return_types_name_the_key_and_module():
    cfg = _config("--model.factory=byo_models:returns_dict")
    with pytest.raises(ConfigError, match="'model.factory' = 'byo_models:returns_dict' returned a dict; "
                                          "it must return a torch.nn.Module"):
        build_model(cfg, BYO)
    cfg = _config("--data.factory=byo_data:build_iterable", "--data.kwargs={}")
    with pytest.raises(ConfigError, match="'data.factory' = 'byo_data:build_iterable' returned a generator; "
                                          "it must return a map-style dataset"):
        build_datasets(cfg, BYO)
    cfg = _config("--data.factory=byo_data:build_train_only", "--data.kwargs={n_train=8}")
    train, heldout, _ = build_datasets(cfg, BYO)
    assert len(train) == 8 and heldout is None  # a train set alone is fine (no evaluation)


def test_batch_the_model_rejects_and_non_scalar_loss():
    cfg = _config("--model.factory=byo_models:build_positional", "--model.kwargs={}")
    model = build_model(cfg, BYO)
    batch = {"features": torch.zeros(4, 8), "target": torch.zeros(4)}
    with pytest.raises(UserError) as e:
        batch_loss(model, batch, None, first=True)
    msg = str(e.value)
    assert "model(**batch): model Linear raised TypeError" in msg
    assert "{'features': Tensor(4, 8) float32, 'target': Tensor(4,) float32}" in msg
    cfg = _config("--model.factory=byo_models:build_predictor")
    model = build_model(cfg, BYO)
    with pytest.raises(UserError, match=r"the loss from model Predictor's output is Tensor\(4,\) float32, "
                                        r"not a scalar tensor"):
        batch_loss(model, batch, None)
    cfg = _config("--model.factory=byo_models:build_predictor", "--train.loss=byo_models:mse")
    loss = batch_loss(model, batch, build_loss(cfg, BYO))
    assert loss.dim() == 0  # train.loss covers a model that returns predictions


def test_rejected_batch_through_disttrain_train(tmp_path):
    """The first forward fails on the rank: one line naming the batch and the model, exit 2."""
    proc = run_disttrain(["train", TOML, "--parallel.nproc=1", "--model.factory=byo_models:build_positional",
                          "--model.kwargs={}", f"--train.out_dir={tmp_path}"], timeout=90)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the first batch failed in model(**batch): model Linear raised TypeError" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_refuses_changed_factory_or_kwargs():
    from disttrain.config import to_dict
    from disttrain.train import resume_plan

    assert resume_plan.classify("model.factory") == "refuse" and resume_plan.classify("train.loss") == "refuse"
    cfg = load_config(BYO / "byo.toml")
    saved = to_dict(cfg)
    flat = resume_plan._flatten(saved)
    assert flat["model.kwargs"] == {"n_in": 8, "width": 32, "dropout": 0.1}  # compared whole
    assert "model.hf_config" in flat and "data.kwargs" in flat
