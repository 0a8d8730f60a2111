"""The process group's backend fits every collective's device (P-INIT-1), a world of 1
under a launcher still has a group, and the grad scaler syncs with the host once a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_disttrain, worker_env

from disttrain.runtime import process_group, processes

TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
        "--data.max_bytes=40000", "--train.batch_size=4", "--train.steps=4", "--train.eval_every=2",
        "--train.eval_batches=2", "--train.log_every=1", "--checkpoint.every=2"]


def test_group_backend_per_device():
    assert process_group.group_backend("cpu") == "gloo"
    assert process_group.group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group.group_backend("cuda", "nccl") == "cpu:gloo,cuda:nccl"
    assert process_group.group_backend("cuda", "gloo") == "gloo"
    assert process_group.group_backend("xpu") == "cpu:gloo,xpu:xccl"


def test_init_on_a_gpu_gives_host_tensors_a_gloo_backend_mock_cuda(monkeypatch):
    """CUDA and NCCL cannot run here: they are mocked. What `init` hands to
    `init_process_group` on a GPU must name a CPU backend, or every metric, vote and
    generation id (CPU tensors) would go through NCCL, which takes CUDA tensors only."""
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group.dist, "init_process_group", lambda **kw: seen.update(kw))
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    try:
        info = process_group.init(device="cuda")
    finally:
        processes.STATE.rank_info = None  # no fake CUDA rank for the tests that follow
    assert seen["backend"] == "cpu:gloo,cuda:nccl" and info.backend == seen["backend"]
    assert seen["device_id"] == torch.device("cuda", 0)


def test_every_collective_of_the_trainer_uses_a_device_its_backend_takes(tmp_path):
    """The real trainer on 2 ranks (eval, checkpoints, metrics, preemption vote, guard)
    with every torch.distributed collective checked by tests/device_rule/sitecustomize.py."""
    log = tmp_path / "calls.jsonl"
    env = worker_env(DEVICE_RULE_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "device_rule"), env["PYTHONPATH"]])
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", *TINY, f"--train.out_dir={tmp_path / 'run'}"],
                         env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({c["pid"] for c in calls}) == 2 and len(calls) > 10
    assert all(set(c["devices"]) <= set(c["allowed"]) for c in calls)


SCRIPT = """
import torch, torch.distributed as dist
import disttrain as dt
with dt.distributed() as info:
    t = torch.ones(1)
    if dist.is_initialized():
        dist.all_reduce(t)
    print(f"group={dist.is_initialized()} world={info.world_size} sum={t.item()}")
"""


def test_a_world_of_one_under_a_launcher_has_a_group(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    proc = run_disttrain(["run", "--nproc", "1", str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "group=True world=1 sum=1.0" in proc.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in worker_env().items() if k not in ("WORLD_SIZE", "RANK")})
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "group=False world=1" in plain.stdout


@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_syncs_with_the_host_once_per_step(monkeypatch, overflow):
    from disttrain.parallel.precision import AgreedGradScaler

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = AgreedGradScaler(init_scale=1024.0)
    model(torch.randn(2, 8)).sum().backward()
    if overflow:
        model[3].weight.grad[0, 0] = float("inf")
    expected = [p.grad.clone() / 1024.0 for p in model.parameters()]
    syncs = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: (syncs.append(_n), _o(self, *a, **k))[1])
    assert scaler.unscale_(optimizer) is overflow
    monkeypatch.undo()
    assert len(syncs) == 1, syncs
    if not overflow:
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=False))
