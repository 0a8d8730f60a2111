"""The CUDA side of fast recovery (docs/elastic.md): the host-copy paths run on the CPU
here (pinned memory, side streams and events degrade to plain copies); the NCCL
recovery itself runs only on a machine with at least 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from conftest import run_disttrain, worker_env

from disttrain.elastic.buddy_copy import pack, unpack
from disttrain.elastic.host_copy import HostCopy, host_buffer, on_cuda


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(3, 4, generator=g), "b": torch.zeros(4, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
            "meta": {"step": 7, "epoch": 1}}


def test_pack_through_a_host_copy_round_trips_on_the_cpu():
    state, copier = _state(), HostCopy()
    buf = pack(state, copier=copier)
    copier.wait()  # a no-op without CUDA
    back = unpack(buf, template=None)
    assert back["meta"] == state["meta"] and back["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])


def test_host_copy_degrades_to_plain_copies_on_the_cpu():
    copier = HostCopy()
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    copier.copy([(dst, src)])
    copier.wait()
    assert torch.equal(dst, src) and copier.event is None and copier.stream is None
    assert not on_cuda([src])
    assert host_buffer(16, pinned=True).numel() == 16  # pinned only where CUDA exists
    with copier.context():
        pass


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL recovery needs 2 GPUs")
def test_nccl_kill_9_recovers_in_memory_bit_identical(tmp_path):
    base = ["train", "examples/tiny_gpt.toml", "--model.n_layer=1", "--train.steps=8",
            "--train.eval_every=0", "--checkpoint.every=4", "--parallel.device=cuda",
            "--elastic.fast_recovery=true"]
    ref = run_disttrain([*base, f"--train.out_dir={tmp_path / 'ref'}"], timeout=400)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = run_disttrain([*base, f"--train.out_dir={tmp_path / 'got'}"], timeout=400,
                        env=worker_env(DISTTRAIN_FAULT="kill@backward:rank=1,step=6"))
    assert got.returncode == 0, got.stderr[-3000:]
    assert "warm spare took over" in got.stderr and "taken from rank 0's memory" in got.stderr
    a = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "got" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nccl_abort_is_harmless_without_nccl_groups():
    """The failure path's abort runs on CPU too: no NCCL group, nothing aborted, no error."""
    from disttrain.elastic.fast_recovery import nccl_expected
    from disttrain.runtime import torch_compat

    assert torch_compat.abort_process_groups() is False
    assert nccl_expected("gloo", "auto") is False and nccl_expected("auto", "cpu") is False
