"""The storage format (docs/checkpoints.md "Storage format"): a checkpoint loads with
every unpickler forbidden, and a checkpoint written by an earlier format (the committed
fixture tests/data/checkpoint_v1: DCP's default records and a pickled `.metadata`,
saved at world size 2 under DDP) still loads, bit for bit, here at world size 1."""

import json
import pickle
import shutil
import sys

import pytest
import torch
from conftest import WORKERS
from safetensors.torch import load_file

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, full_state, mismatches, train  # noqa: E402

import disttrain as dt  # noqa: E402
from disttrain.builtin import GPTConfig  # noqa: E402

FIXTURE = WORKERS.parent / "data" / "checkpoint_v1"
FIXTURE_CFG = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1)  # make_fixture.py's


class PickleForbidden(AssertionError):
    pass


@pytest.fixture
def no_pickle(monkeypatch):
    """Every way to unpickle raises: the pickle module's loaders and torch.load (whose
    weights_only unpickler is a pickle reader too)."""
    def refuse(*args, **kwargs):
        raise PickleForbidden("an unpickler was called")

    class Refused:
        def __init__(self, *args, **kwargs):
            refuse()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refused)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    return refuse


def test_the_guard_does_refuse_an_unpickle(no_pickle):
    with pytest.raises(PickleForbidden):
        pickle.loads(b"\x80\x04K\x01.")
    with pytest.raises(PickleForbidden):
        torch.load("any.pt", weights_only=True)


def test_a_checkpoint_loads_with_every_unpickler_forbidden(tmp_path, no_pickle):
    saved = build("ddp")
    train(saved, 2)
    dt.save(saved, tmp_path / "run")
    step_dir = tmp_path / "run" / "step-00000002"
    json.loads((step_dir / ".metadata").read_text())  # DCP's metadata, as JSON
    loaded = build("ddp")
    assert dt.load(loaded, tmp_path / "run") == step_dir
    assert loaded.step == 2 and loaded.sampler.state_dict() == saved.sampler.state_dict()
    assert mismatches(full_state(loaded), full_state(saved)) == []
    assert loaded.optimizer.state_dict()["param_groups"] == saved.optimizer.state_dict()["param_groups"]


def test_a_checkpoint_of_the_first_format_still_loads_bit_for_bit(tmp_path):
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    state = build("ddp", FIXTURE_CFG, fused=True)
    assert dt.load(state, tmp_path / "run") == tmp_path / "run" / "step-00000002"
    assert state.step == 2
    assert mismatches(full_state(state), load_file(FIXTURE / "expected.safetensors")) == []
    state.step = 3  # and a save after it is in the current format
    dt.save(state, tmp_path / "run")
    json.loads((tmp_path / "run" / "step-00000003" / ".metadata").read_text())


def test_a_fused_attention_checkpoint_into_the_split_gpt_names_the_split(tmp_path):
    """The fixture holds the built-in GPT's fused `attn.qkv`; the GPT of today has q, k
    and v apart: the refusal says so and how to carry the run over."""
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    from disttrain.checkpoint.checkpoint_errors import CheckpointMismatch

    with pytest.raises(CheckpointMismatch) as refused:
        dt.load(build("ddp", FIXTURE_CFG), tmp_path / "run")
    text = str(refused.value)
    assert "fused `attn.qkv`" in text and "three equal row blocks" in text, text
