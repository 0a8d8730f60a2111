"""A load's shortcuts are exact (P-CKPT-1, P-CKPT-4): the plan built without DCP's
planner is DCP's own plan, and skipping torch's `set_state_dict` leaves the model and
optimizer exactly as it would. Where either is not provable, the load takes torch's way.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from disttrain.checkpoint import Checkpointer, TrainState
from disttrain.checkpoint.direct_load import direct_plan
from disttrain.checkpoint.in_place import model_in_place, optimizer_state
from disttrain.checkpoint.state import param_fqns
from disttrain.checkpoint.storage_formats import read_metadata
from disttrain.runtime import torch_compat


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("empty", torch.zeros(0, 4))

    def forward(self, x):
        return self.head(self.body(self.emb(x))).sum()


def _trained(lr: float = 0.01):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([{"params": [model.emb.weight], "lr": lr},
                             {"params": list(model.body.parameters()), "lr": lr / 2}])
    for _ in range(2):
        model(torch.arange(5)).backward()
        opt.step()
        opt.zero_grad()
    return TrainState(model=model, optimizer=opt)


def _items(plan) -> list:
    return sorted((dataclasses.astuple(i) for i in plan.items), key=repr)


def test_the_direct_plan_is_dcps_own_plan(tmp_path):
    state = _trained()
    ck = Checkpointer(tmp_path, keep_last=0)
    step_dir = ck.save(state)
    flat, _ = torch_compat.flatten_with_paths(state.tensor_state())
    md = read_metadata(step_dir)
    assert _items(direct_plan(flat, md)) == _items(create_default_local_load_plan(flat, md, True))
    # another layout: a saved tensor in two chunks (an FSDP save) is DCP's to plan
    key = "model.body.0.weight"
    two = copy.deepcopy(md)
    two.state_dict_metadata[key].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 6])),
                                           ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([3, 6]))]
    assert direct_plan(flat, two) is None
    assert direct_plan({k: v for k, v in flat.items() if k != key}, md) is None  # keys on one side only
    assert direct_plan({**flat, key: flat[key].to("meta")}, md) is None


def _flat_equal(a: dict, b: dict) -> None:
    flat_a, flat_b = torch_compat.flatten_state_dict(a), torch_compat.flatten_state_dict(b)
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        if isinstance(flat_a[k], torch.Tensor):
            assert torch.equal(flat_a[k], flat_b[k]) and flat_a[k].dtype == flat_b[k].dtype, k
        else:
            assert flat_a[k] == flat_b[k], k


def _fresh() -> TrainState:
    state = _trained(lr=0.5)  # other weights, other learning rates
    state.model(torch.arange(5)).backward()
    state.optimizer.step()
    return state


def test_a_load_in_place_equals_dcps_planner_and_torchs_set_state_dict(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep_last=0)
    step_dir = ck.save(_trained())
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as torch_sd

    import disttrain.checkpoint.checkpointer as checkpointer
    import disttrain.checkpoint.direct_load as direct_load

    def refused(*args, **kwargs):
        raise AssertionError("the load went through DCP's planner or torch's set_state_dict")

    fast = _fresh()
    with monkeypatch.context() as patched:
        patched.setattr(dcp, "load", refused)
        patched.setattr(torch_sd, "set_state_dict", refused)
        assert ck.load(fast, step_dir) == step_dir

    monkeypatch.setattr(direct_load, "direct_plan", lambda flat, md: None)  # DCP plans
    monkeypatch.setattr(checkpointer, "param_fqns", lambda sd: None)  # torch's set_state_dict
    slow = _fresh()
    assert ck.load(slow, step_dir) == step_dir
    _flat_equal(fast.model.state_dict(), slow.model.state_dict())
    _flat_equal(fast.optimizer.state_dict(), slow.optimizer.state_dict())
    assert [g["lr"] for g in fast.optimizer.param_groups] == [0.01, 0.005]
    assert fast.model.head.weight is fast.model.emb.weight


def test_the_shortcut_is_refused_where_it_is_not_provable():
    state = _trained()
    tensors = state.tensor_state()
    assert model_in_place(state.model, tensors["model"])
    cloned = {k: v.clone() for k, v in tensors["model"].items()}
    assert not model_in_place(state.model, cloned)  # not the parameters themselves
    handle = state.model.body.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not model_in_place(state.model, tensors["model"])  # a hook sees the load
    handle.remove()
    assert not model_in_place(nn.BatchNorm1d(3), nn.BatchNorm1d(3).state_dict())  # its own loader
    fqns = param_fqns({"tensors": tensors})
    assert optimizer_state(state.optimizer, tensors["optim"], fqns) is not None
    moved = [list(reversed(fqns[0] + fqns[1]))[:len(fqns[0])], fqns[1]]
    assert optimizer_state(state.optimizer, tensors["optim"], moved) is None  # other groups
    assert optimizer_state(state.optimizer, tensors["optim"], None) is None


@pytest.mark.parametrize("with_paths", [True, False])
def test_the_fallback_flattening_names_the_same_keys(with_paths):
    state = {"model": {"a.b": torch.zeros(1), "c": {"d": torch.ones(2)}}, "step": 3}
    flat, paths = torch_compat.flatten_with_paths(state)
    fallback = torch_compat._key_paths(state, ())
    assert set(flat) == set(fallback) == set(paths)
    if with_paths:
        assert paths == fallback


def test_a_damaged_copy_of_a_tied_weight_fails_the_load(tmp_path):
    """Both names of a tied weight are read into one memory: the damaged first record
    must fail the load although the intact second one overwrites its bytes (the hash of
    a record is computed before anything is read over it)."""
    import json

    from disttrain.checkpoint import CheckpointCorrupt

    ck = Checkpointer(tmp_path, keep_last=0)
    step_dir = ck.save(_trained())
    doc = json.loads((step_dir / ".metadata").read_bytes())
    chunks = [doc["tensors"][k]["chunks"][0] for k in ("model.emb.weight", "model.head.weight")]
    first = min(chunks, key=lambda c: (c["file"], c["offset"]))
    assert {c["file"] for c in chunks} == {first["file"]}
    data = bytearray((step_dir / first["file"]).read_bytes())
    data[first["offset"] + 5] ^= 0xFF
    (step_dir / first["file"]).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="fails its xxh3_128 checksum"):
        ck.load(_fresh(), step_dir)
