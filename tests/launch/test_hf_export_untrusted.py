"""Issue 49, finding 1: `disttrain ckpt export --hf` runs no code a checkpoint names.

A checkpoint's `state.json` says which Hugging Face model it holds (`model.hf` +
`model.hf_config`, or `model.hf_path`). Those are values to build a config from, never
loader options: `trust_remote_code` and an `auto_map` that would make transformers
import a .py of the checkpoint's choosing are refused in one line, and nothing of that
.py runs. The folder is the committed first-format fixture with its `state.json`
rewritten and its manifest's digest recomputed, as an author of a folder would.
"""

import json
import shutil

import pytest
from conftest import WORKERS, run_disttrain, worker_env

from disttrain.checkpoint.digests import digest_bytes

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

FIXTURE = WORKERS.parent / "data" / "checkpoint_v1" / "run"
STEP = "step-00000002"


def _fixture(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run, run / STEP


def _set_model(step_dir, model: dict):
    """state.json names `model` as the run's model section; the manifest agrees."""
    state = json.loads((step_dir / "state.json").read_text())
    state.setdefault("config", {})["model"] = model
    data = json.dumps(state).encode()
    (step_dir / "state.json").write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["state.json"] = digest_bytes(data)
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _code_folder(parent, marker, config: dict):
    """A save_pretrained-looking folder whose config.json maps AutoConfig to a .py of
    its own; importing that .py creates `marker`."""
    folder = parent / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil_config.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n"
        "    model_type = 'evil'\n"
    )
    return folder


def _export(run, tmp_path):
    # A private cache: transformers copies a remote-code module there before importing it.
    env = worker_env(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    return run_disttrain(["ckpt", "export", str(run), "--hf", str(tmp_path / "out")], cwd=tmp_path, env=env)


def _one_error_line(proc):
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("disttrain ckpt: error:")]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("model_type", ["evil", "gpt2"])
def test_an_hf_path_into_the_checkpoint_with_trust_remote_code_runs_nothing(tmp_path, model_type):
    """The issue's case: `hf_config = {"trust_remote_code": true}` and an `hf_path`
    (relative, taken from the current folder) to a folder inside the checkpoint whose
    config.json has an `auto_map` and the .py it names (an unknown model type, and a
    known one the auto_map would replace)."""
    marker = tmp_path / "ran"
    run, step_dir = _fixture(tmp_path)
    config = {"model_type": model_type, "auto_map": {"AutoConfig": "evil_config.EvilConfig"}}
    _code_folder(step_dir, marker, config)
    _set_model(step_dir, {"hf_path": f"run/{STEP}/evil", "hf_config": {"trust_remote_code": True}})
    line = _one_error_line(_export(run, tmp_path))
    assert not marker.exists(), "the checkpoint's .py ran"
    assert str(step_dir / "state.json") in line and "trust_remote_code" in line, line
    assert not (tmp_path / "out").exists()


def test_an_auto_map_in_the_named_config_json_is_refused(tmp_path):
    """Without trust_remote_code the folder's own auto_map is refused, naming its file."""
    marker = tmp_path / "ran"
    run, step_dir = _fixture(tmp_path)
    folder = _code_folder(
        step_dir, marker, {"model_type": "gpt2", "auto_map": {"AutoConfig": "evil_config.EvilConfig"}}
    )
    _set_model(step_dir, {"hf_path": f"run/{STEP}/evil"})
    line = _one_error_line(_export(run, tmp_path))
    assert not marker.exists()
    assert str(folder / "config.json") in line and "auto_map" in line, line


@pytest.mark.parametrize(
    "hf_config, word",
    [
        ({"trust_remote_code": True}, "trust_remote_code"),
        ({"auto_map": {"AutoModelForCausalLM": "evil_config.EvilModel"}}, "auto_map"),
        ({"_name_or_path": "evil"}, "_name_or_path"),
        ({"n_layer": {"__class__": "x"}, "n_embd": 32}, "n_layer"),
        ({"attn_implementation": "some-org/kernels"}, "attn_implementation"),
    ],
)
def test_loader_options_in_a_stored_hf_config_are_refused(tmp_path, hf_config, word):
    run, step_dir = _fixture(tmp_path)
    _set_model(step_dir, {"hf": "gpt2", "hf_config": hf_config})
    line = _one_error_line(_export(run, tmp_path))
    assert str(step_dir / "state.json") in line and word in line, line


def test_the_trainer_refuses_the_same_in_its_own_config(tmp_path):
    """`disttrain train`'s model section goes through the same check: a config that
    asks for remote code, or an hf_path folder with an auto_map, is one UserError."""
    from disttrain.errors import UserError
    from disttrain.train.hf_models import build_hf_model

    marker = tmp_path / "ran"
    with pytest.raises(UserError, match="model.hf_config: 'trust_remote_code' chooses code"):
        build_hf_model({"hf": "gpt2", "hf_config": {"trust_remote_code": True}})
    _code_folder(tmp_path, marker, {"model_type": "gpt2", "auto_map": {"AutoConfig": "evil_config.EvilConfig"}})
    with pytest.raises(UserError, match="config.json .*'auto_map' chooses code"):
        build_hf_model({"hf_path": "evil"}, config_dir=tmp_path)
    assert not marker.exists()


def test_a_stored_hf_path_outside_the_checkpoint_folder_is_refused_unread(tmp_path):
    """A checkpoint's state.json may name any absolute `hf_path`; its config.json is
    never opened outside the checkpoint's folder, nor through a link, nor as a FIFO."""
    import os

    from disttrain.config.hf_model_config import hf_config_from_section, read_config_json
    from disttrain.errors import UserError

    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"model_type": "gpt2", "secret_key": 1}))
    with pytest.raises(UserError, match="outside the checkpoint's folder") as refused:
        hf_config_from_section({"hf_path": str(outside)}, stored_in="state.json", inside=root)
    assert "secret_key" not in str(refused.value)
    (root / "linked").symlink_to(outside)  # a folder inside that leads outside
    with pytest.raises(UserError, match="outside the checkpoint's folder"):
        hf_config_from_section({"hf_path": str(root / "linked")}, stored_in="state.json", inside=root)
    (root / "model").mkdir()
    (root / "model" / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(UserError, match="symlink"):
        read_config_json(root / "model", "state.json", follow=False)
    os.mkfifo(root / "fifo.json")
    (root / "pipe").mkdir()
    os.rename(root / "fifo.json", root / "pipe" / "config.json")
    for follow in (False, True):  # the trainer's own folder too: refused, not waited on
        with pytest.raises(UserError, match="FIFO"):
            read_config_json(root / "pipe", "model.hf_path", follow=follow)
    assert read_config_json(root / "model", "model.hf_path") == ("gpt2", {"secret_key": 1})  # the user's own
