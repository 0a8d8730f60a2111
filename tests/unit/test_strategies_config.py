"""Strategy options that cannot work are clear `ConfigError`s before anything starts,
and the single-process pieces of issue 3 (P-DDP-1,3,7, P-FSDP-3,6,7,9)."""

import warnings

import pytest
import torch
import torch.nn as nn

import disttrain as dt
from disttrain.builtin import GPT, MLP, GPTConfig, MLPConfig
from disttrain.config import load_config
from disttrain.errors import ConfigError, UserError
from disttrain.parallel.blocks import find_blocks
from disttrain.parallel.mesh import Layout
from disttrain.parallel.precision import AgreedGradScaler

TINY = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("overrides, expected", [
    (["--parallel.strategy=ddp", "--parallel.cpu_offload=true"], "cpu_offload needs a sharding strategy"),
    (["--parallel.strategy=zero1", "--parallel.cpu_offload=true"], "cpu_offload needs a sharding strategy"),
    (["--parallel.strategy=fsdp1", "--train.precision=\"fp16\""],
     "'fp16' is not available with parallel.strategy 'fsdp1'"),
    (["--parallel.strategy=fsdp1", "--parallel.cpu_offload=true", "--parallel.device=cpu"],
     "Use --parallel.strategy=fsdp, whose CPUOffloadPolicy runs on CPU"),
    (["--parallel.strategy=fsdp", "--parallel.sharding=hybrid", "--parallel.nproc=4",
      "--parallel.shard_group_size=3", "--parallel.device=cpu"], "does not divide the world of 4 ranks"),
    (["--parallel.strategy=fsdp", "--parallel.shard_group_size=-1"], "'parallel.shard_group_size' is -1"),
    (["--parallel.strategy=fsdp", "--parallel.shard_group_size=2"], "applies only to --parallel.sharding=hybrid"),
    (["--parallel.strategy=ddp", "--parallel.sharding=grad_op"], "sharding modes apply only to strategy fsdp"),
    (["--parallel.strategy=dp", "--parallel.nproc=2", "--parallel.device=cpu"], "nest DataParallel inside DDP"),
    (["--parallel.strategy=dp", "--parallel.nproc=1", "--parallel.sync_batchnorm=true"], "DataParallel's threads"),
    (["--parallel.strategy=fsdp", "--parallel.static_graph=true"], "are DDP options"),
    (["--train.precision=\"fp4\""], "'train.precision' is 'fp4'; choose one of fp32, bf16, fp16, fp8"),
])
def test_illegal_combination_is_a_config_error(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["--parallel.strategy=fsdp", "--parallel.sharding=hybrid", "--parallel.nproc=4",
     "--parallel.shard_group_size=2", "--parallel.device=cpu"],
    ["--parallel.strategy=fsdp", "--parallel.cpu_offload=true", "--train.precision=\"bf16\""],
    ["--parallel.strategy=zero1", "--train.precision=\"fp16\""],
    ["--parallel.strategy=dp", "--parallel.nproc=1", "--parallel.device=cpu"],
])
def test_legal_combination_loads(overrides):
    cfg = load_config(None, overrides)
    strategy = next(o.split("=", 1)[1] for o in overrides if o.startswith("--parallel.strategy="))
    assert cfg.parallel.strategy == strategy  # loaded as given, not refused or replaced


def test_layout_grids_P_FSDP_4():
    assert Layout.for_strategy("fsdp", "full", 4) == Layout(4, 1, 4)
    assert Layout.for_strategy("fsdp", "hybrid", 4, shard_group_size=2) == Layout(4, 2, 2)
    assert Layout.for_strategy("fsdp", "hybrid", 8, local_world_size=4).shard == 4
    assert Layout.for_strategy("fsdp", "none", 4) == Layout(4, 4, 1)
    assert Layout.for_strategy("ddp", "full", 4) == Layout(4, 4, 1)
    assert Layout(4, 2, 2).replica_of(3) == 1 and Layout(4, 2, 2).is_hybrid
    with pytest.raises(ConfigError, match=r"Use one of \[1, 2, 3, 6\]"):
        Layout.for_strategy("fsdp", "hybrid", 6, shard_group_size=4)


def test_blocks_found_from_no_split_modules_P_FSDP_3():
    model = GPT(TINY)
    assert [type(b).__name__ for b in find_blocks(model)] == ["Block", "Block"]
    assert find_blocks(model, "model") == []
    assert len(find_blocks(model, "Block, LayerNorm")) == 3  # LayerNorms inside blocks drop out
    assert find_blocks(MLP(MLPConfig())) == []  # no _no_split_modules: whole-model unit
    with pytest.raises(ConfigError, match="Classes in this model"):
        find_blocks(model, "GPT2Block")


def test_nested_wrapping_is_an_error_P_DDP_3():
    with pytest.raises(UserError, match="nests data parallelism"):
        dt.wrap(nn.DataParallel(MLP(MLPConfig())))
    inner = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    with pytest.raises(UserError, match="submodule '0'"):
        dt.wrap(inner)
    with pytest.raises(UserError, match="nests"):
        dt.wrap(dt.wrap(MLP(MLPConfig())))


def test_optimizer_built_before_wrap_is_refused_P_DDP_3_P_FSDP_7():
    plain = MLP(MLPConfig())
    early = torch.optim.SGD(MLP(MLPConfig()).parameters(), lr=0.1)  # not the wrapped model's
    model = dt.wrap(plain)
    with pytest.raises(UserError, match="built before dt.wrap"):
        dt.Accumulator(model, early, 1)
    with pytest.raises(UserError, match="needs the module returned by dt.wrap"):
        dt.make_optimizer(MLP(MLPConfig()), torch.optim.SGD, lr=0.1)
    dt.Accumulator(model, dt.make_optimizer(model, torch.optim.SGD, lr=0.1), 1)


def test_dp_on_cpu_is_a_world_of_one_and_warns_once_P_DDP_1():
    from disttrain.runtime.processes import STATE

    STATE.said.discard("dp on the CPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = dt.wrap(MLP(MLPConfig()), strategy="dp")
        dt.wrap(MLP(MLPConfig()), strategy="dp")
    assert isinstance(a, nn.DataParallel)
    assert sum("world of 1" in str(w.message) for w in caught) == 1
    out, loss = a(torch.randn(3, 16), torch.randn(3, 4))
    assert out.shape == (3, 4) and dt.unwrap(a).__class__ is MLP


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_dp_splits_the_batch_over_gpus_P_DDP_1():
    model = dt.wrap(MLP(MLPConfig()), strategy="dp")
    seen = []
    dt.unwrap(model).fc1.register_forward_hook(lambda m, i, o: seen.append(i[0].device))
    model(torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda"))
    assert len(set(seen)) == torch.cuda.device_count()


def test_bf16_wrap_autocasts_forward_and_returns_fp32_P_DDP_7():
    model = dt.wrap(GPT(TINY), precision="bf16")
    seen = []
    dt.unwrap(model).blocks[0].mlp[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    logits, loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # the hook left autocast


def test_autocast_refuses_an_unknown_precision_in_one_line():
    with pytest.raises(UserError, match="'fp4' is not one of 'fp32', 'bf16', 'fp16', 'fp8'"):
        dt.autocast("fp4")


def test_agreed_scaler_skips_backs_off_and_grows():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = AgreedGradScaler(init_scale=4.0, growth_interval=2)
    for grad, stepped in ((float("inf"), False), (4.0, True), (4.0, True)):
        p.grad = torch.full((3,), grad)
        assert scaler.step(opt) is stepped
        scaler.update()
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 4.0  # 4 -> 2 (skip) -> 2 -> 4
    assert torch.equal(p.detach(), torch.full((3,), -3.0))  # two steps of grad 4/2 and 4/2
    restored = AgreedGradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == 4.0
