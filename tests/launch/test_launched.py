"""The launcher's result handed to the ranks (`disttrain.train.launcher_findings`): written where
only the user can read it, removed after the job, read by a rank only on its first
attempt and only for the arguments it was written for; and the launcher's chain from
`cli.py` to the call that starts the workers, three files."""

import inspect
import json
import os
import stat
from pathlib import Path

import pytest

from disttrain import cli
from disttrain.config import load_config
from disttrain.train import launcher_findings, resume_plan
from disttrain.train.launcher_findings import Launched

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "disttrain"
ARGV = ["examples/tiny_gpt.toml", "--train.steps=7", "--optim.lr=0.002"]


@pytest.fixture
def first_attempt_env(monkeypatch):
    for key in (launcher_findings.ENV, launcher_findings.RESTART_ENV, launcher_findings.ROLE_ENV):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _plan():
    return resume_plan.ResumePlan("/ckpt/step-4", 4, {"optim": {"lr": 0.001}},
                             changes=[("optim.lr", 0.001, 0.002), ("optim.betas", [0.9, 0.95], [0.9, 0.99])])


def test_handed_file_is_private_named_for_the_block_and_removed_after(first_attempt_env):
    cfg = load_config(ARGV[0], ARGV[1:])
    with launcher_findings.handed(Launched(tuple(ARGV), cfg, resume_plan.Inspected(_plan()))) as path:
        assert os.environ[launcher_findings.ENV] == str(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert json.loads(path.read_text())["argv"] == ARGV
        got = launcher_findings.read(ARGV)
    assert got is not None and got.cfg == cfg and got.argv == tuple(ARGV)
    assert got.inspected == resume_plan.Inspected(_plan())  # the rows come back as tuples
    assert not path.exists() and not path.parent.exists() and launcher_findings.ENV not in os.environ


def test_handed_file_is_removed_when_the_launch_raises(first_attempt_env):
    with pytest.raises(RuntimeError, match="boom"):
        with launcher_findings.handed(Launched(tuple(ARGV), load_config(ARGV[0], ARGV[1:]))) as path:
            raise RuntimeError("boom")
    assert not path.parent.exists() and launcher_findings.ENV not in os.environ


def test_a_fresh_start_and_not_inspected_are_told_apart(first_attempt_env):
    cfg = load_config(ARGV[0], ARGV[1:])
    for inspected in (None, resume_plan.Inspected(None)):
        with launcher_findings.handed(Launched(tuple(ARGV), cfg, inspected)):
            assert launcher_findings.read(ARGV).inspected == inspected


@pytest.mark.parametrize("env", [{launcher_findings.RESTART_ENV: "1"}, {launcher_findings.ROLE_ENV: "spare"},
                                 {launcher_findings.ROLE_ENV: "newcomer"}])
def test_a_rank_after_a_restart_or_a_promoted_spare_parses_again(first_attempt_env, env):
    with launcher_findings.handed(Launched(tuple(ARGV), load_config(ARGV[0], ARGV[1:]))):
        assert launcher_findings.read(ARGV) is not None
        for key, value in env.items():
            first_attempt_env.setenv(key, value)
        assert launcher_findings.read(ARGV) is None


def test_other_arguments_an_inherited_name_or_a_broken_file_are_not_used(first_attempt_env, tmp_path):
    cfg = load_config(ARGV[0], ARGV[1:])
    with launcher_findings.handed(Launched(tuple(ARGV), cfg)) as path:
        assert launcher_findings.read([ARGV[0], "--train.steps=8"]) is None
        with launcher_findings.handed(None) as none:  # a launch that hands nothing hides an outer file
            assert none is None and launcher_findings.ENV not in os.environ
        assert os.environ[launcher_findings.ENV] == str(path)
        path.write_text("{not json")
        assert launcher_findings.read(ARGV) is None
    broken = tmp_path / "launcher_findings.json"
    broken.write_text(json.dumps({"argv": ARGV, "config": {"train": {"stepz": 1}}, "inspected": None}))
    first_attempt_env.setenv(launcher_findings.ENV, str(broken))
    assert launcher_findings.read(ARGV) is None


def test_a_handed_inspection_is_used_without_reading_the_checkpoint_inspect_mocked(monkeypatch):
    monkeypatch.setattr(resume_plan, "inspect", lambda cfg: pytest.fail("inspected again"))
    cfg = load_config(ARGV[0], ARGV[1:])
    assert resume_plan.inspect_once(cfg, resume_plan.Inspected(_plan())) == _plan()
    assert resume_plan.inspect_once(cfg, resume_plan.Inspected(None)) is None
    monkeypatch.setattr(resume_plan, "inspect", lambda cfg: "read")
    assert resume_plan.inspect_once(cfg, None) == "read"


def test_launcher_chain_is_cli_train_command_run_command_torchrun_mocked(monkeypatch, tmp_path):
    """`disttrain train` in this process with the workers' start replaced: the files
    between `cli.main` and that call are three, and the handed file is there, private,
    for the call and gone after it."""
    import torch.distributed.run

    monkeypatch.setattr(os, "environ", {**os.environ, "DISTTRAIN_WARM_WORKERS": "0"})
    monkeypatch.delitem(os.environ, launcher_findings.ENV, raising=False)
    seen = {}

    def started(args):
        seen["chain"] = [f.filename for f in reversed(inspect.stack()[1:]) if f.filename.startswith(str(SRC))]
        path = Path(os.environ[launcher_findings.ENV])
        seen["path"], seen["mode"] = path, stat.S_IMODE(path.stat().st_mode)
        seen["handed"] = json.loads(path.read_text())

    monkeypatch.setattr(torch.distributed.run, "run", started)
    out = tmp_path / "run"
    assert cli.main(["train", *ARGV, f"--train.out_dir={out}", "--model.n_layer=1"]) == 0
    files = list(dict.fromkeys(str(Path(f).relative_to(SRC)) for f in seen["chain"]))
    assert files == ["cli.py", "launch/train_command.py", "launch/run_command.py"]
    assert seen["mode"] == 0o600 and not seen["path"].parent.exists()
    assert seen["handed"]["argv"] == [*ARGV, f"--train.out_dir={out}", "--model.n_layer=1"]
    assert seen["handed"]["config"]["model"]["n_layer"] == 1
    assert seen["handed"]["inspected"] == {"plan": None}  # inspected: a fresh start
