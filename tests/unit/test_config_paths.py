"""One rule for relative paths (config/path_keys.py): a path in a TOML file is taken
from that file's folder, one in a `--section.key=value` override from the current
folder, and a default stays relative to the current folder. It used to be two rules:
data.tokens from the file's folder, train.out_dir from the current one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from disttrain.config import load_config, to_dict
from disttrain.config.path_keys import PATH_KEYS
from disttrain.launch.train_command import help_text
from disttrain.train import resume_plan
from disttrain.train.model_data_loss import build_datasets

TOML = """
[model]
block_size = 8
[data]
tokens = "tok/*.bin"
tokens_heldout = "tok/val.bin"
[train]
out_dir = "out"
[guard]
dir = "../beats"
[checkpoint]
dir = "ckpt"
"""


def _setup(tmp_path: Path, monkeypatch) -> Path:
    """conf/job.toml (with two token files under conf/tok) and the current folder elsewhere."""
    conf = tmp_path / "conf"
    (conf / "tok").mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        (np.arange(200) % 250).astype(np.uint16).tofile(conf / "tok" / name)
    (conf / "job.toml").write_text(TOML)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return conf


def test_every_path_in_a_toml_is_taken_from_its_folder(tmp_path, monkeypatch):
    conf = _setup(tmp_path, monkeypatch)
    cfg = load_config(Path("..") / "conf" / "job.toml")
    assert cfg.train.out_dir == str(conf / "out")
    assert cfg.checkpoint.dir == str(conf / "ckpt")
    assert cfg.guard.dir == str(tmp_path / "beats")
    assert cfg.data.tokens == str(conf / "tok" / "*.bin")
    assert cfg.data.tokens_heldout == str(conf / "tok" / "val.bin")
    train, held, summary = build_datasets(cfg, None)  # no base to join: the config holds it
    assert (len(train), len(held), summary["train_files"]) == (199 // 8, 199 // 8, 1)


def test_hugging_face_folders_in_a_toml_are_taken_from_its_folder(tmp_path, monkeypatch):
    conf = _setup(tmp_path, monkeypatch)
    (conf / "job.toml").write_text('[model]\nhf_path = "gpt"\n[data]\nhf_dataset = "../rows"\n')
    cfg = load_config(conf / "job.toml")
    assert (cfg.model.hf_path, cfg.data.hf_dataset) == (str(conf / "gpt"), str(tmp_path / "rows"))


def test_an_override_is_taken_from_the_current_folder(tmp_path, monkeypatch):
    conf = _setup(tmp_path, monkeypatch)
    cwd = tmp_path / "cwd"
    cfg = load_config(conf / "job.toml", ["--train.out_dir=rel", "--data.tokens=t/a.bin", '--guard={dir = "g"}'])
    assert (cfg.train.out_dir, cfg.data.tokens, cfg.guard.dir) == (
        str(cwd / "rel"),
        str(cwd / "t/a.bin"),
        str(cwd / "g"),
    )
    assert cfg.checkpoint.dir == str(conf / "ckpt")  # not overridden: still the file's
    assert load_config(None, ["--checkpoint.dir=c"]).checkpoint.dir == str(cwd / "c")


def test_defaults_stay_relative_to_the_current_folder(tmp_path, monkeypatch):
    """Only what the file gives is the file's: a key it leaves out keeps its default."""
    conf = _setup(tmp_path, monkeypatch)
    (conf / "job.toml").write_text('[model]\nblock_size = 8\n[data]\ntokens = "tok/*.bin"\n')
    cfg = load_config(conf / "job.toml")
    assert cfg.data.tokens == str(conf / "tok" / "*.bin")
    assert (cfg.train.out_dir, cfg.checkpoint.dir, cfg.guard.dir) == ("runs/tiny_gpt", "", "")
    assert resume_plan.checkpoint_root(cfg).resolve() == tmp_path / "cwd" / "runs" / "tiny_gpt" / "checkpoints"


def test_absolute_and_home_paths_are_kept(tmp_path, monkeypatch):
    conf = _setup(tmp_path, monkeypatch)
    (conf / "job.toml").write_text(f'[train]\nout_dir = "{tmp_path / "abs"}"\n[checkpoint]\ndir = "~/ck"\n')
    cfg = load_config(conf / "job.toml")
    assert (cfg.train.out_dir, cfg.checkpoint.dir) == (str(tmp_path / "abs"), str(Path.home() / "ck"))


def test_the_same_toml_resumes_its_run_from_another_folder(tmp_path, monkeypatch):
    """Started in one folder, restarted in another: the same checkpoint root and data,
    so the checkpoint is found and nothing is refused. A checkpoint of an earlier version
    (paths stored relative, as the TOML wrote them) resumes too; other data is refused."""
    conf = _setup(tmp_path, monkeypatch)
    first = load_config(conf / "job.toml")
    root = resume_plan.checkpoint_root(first)
    root.mkdir(parents=True)
    (root / "state.json").write_text(json.dumps({"step": 4, "config": to_dict(first)}))
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    again = load_config(conf / "job.toml")
    assert resume_plan.checkpoint_root(again) == root == conf / "ckpt"
    plan = resume_plan.plan_for(root, again)
    assert (plan.step, plan.refused, plan.changes) == (4, [], [])
    old = to_dict(first)
    old["data"].update(tokens="tok/*.bin", tokens_heldout="../conf/tok/val.bin")
    (root / "state.json").write_text(json.dumps({"step": 4, "config": old}))
    assert resume_plan.plan_for(root, again).refused == []
    old["data"]["tokens"] = "other/*.bin"
    (root / "state.json").write_text(json.dumps({"step": 4, "config": old}))
    assert [k for k, _, _ in resume_plan.plan_for(root, again).refused] == ["data.tokens"]


def test_train_help_states_the_rule_and_names_every_path_key():
    text = " ".join(help_text().split("config keys")[0].split())
    assert "in CONFIG.toml, relative to the folder of CONFIG.toml" in text
    assert "in --section.key=VALUE, relative to the current folder" in text
    assert "a key left at its default, relative to the current folder" in text
    assert all(key in text for key in PATH_KEYS)
