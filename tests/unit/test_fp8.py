"""Precision fp8 (torchao's Float8 training) on the CPU: each refusal is one line that
names the fix, the compute-capability check against mocked CUDA devices, which layers
are converted, the state dict and checkpoints shared with bf16 both ways, and the
planner's fp8 memory. The FP8 matmul itself needs a GPU: here torchao emulates it
(DISTTRAIN_FP8_EMULATE=1), which runs the same conversion and the same casts."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn

import disttrain as dt
from disttrain.builtin import GPT, GPTConfig
from disttrain.checkpoint import TrainState
from disttrain.config import fp8_rules, load_config
from disttrain.errors import ConfigError, UserError
from disttrain.parallel.fp8 import apply_fp8
from disttrain.plan.memory import Variant, Workload, memory
from disttrain.plan.model_size import from_gpt_config

TINY = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
FP8 = ['--train.precision="fp8"']


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_fp8_on_the_cpu_is_refused_in_one_line_by_config_job_and_wrap(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*FP8, "--parallel.device=cpu"])
    text = one_line(err)
    assert "compute capability 8.9" in text and "this job runs on the CPU" in text
    assert "train.precision = 'bf16'" in text  # the fix
    with pytest.raises(ConfigError, match="runs on the CPU"):
        dt.Job(tmp_path, precision="fp8")  # before the process group starts
    model = GPT(TINY)
    with pytest.raises(ConfigError, match="runs on the CPU"):
        dt.wrap(model, precision="fp8")
    assert not any("Float8" in type(m).__name__ for m in model.modules())  # refused before any change


@pytest.mark.parametrize("overrides, expected", [
    (["--parallel.strategy=fsdp1"], "'fp8' runs with parallel.strategy ddp, zero1, fsdp"),
    (["--parallel.strategy=dp", "--parallel.nproc=1"], "not 'dp'; use one of them, or precision bf16"),
    (['--train.fp8_recipe="blockwise"'], "'train.fp8_recipe' is 'blockwise'; choose one of tensorwise, rowwise"),
])
def test_fp8_with_a_strategy_or_recipe_it_lacks_is_one_line(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*FP8, *overrides])
    assert expected in one_line(err)


def _mock_cuda(monkeypatch, capabilities: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capabilities[index])


def test_mocked_cuda_below_capability_8_9_is_refused_naming_the_device(monkeypatch):
    _mock_cuda(monkeypatch, [(9, 0), (8, 0)])  # an H100 beside an A100
    with pytest.raises(ConfigError) as err:
        load_config(None, [*FP8, "--parallel.nproc=2"])
    text = one_line(err)
    assert "cuda:1 has compute capability 8.0" in text and "train.precision = 'bf16'" in text
    fp8_rules.check_fp8_device("cuda", 0)  # a rank checks its own device: the H100 passes
    with pytest.raises(ConfigError, match="cuda:1 has compute capability 8.0"):
        fp8_rules.check_fp8_device("cuda", 1)


def test_mocked_cuda_of_capability_8_9_and_9_0_loads(monkeypatch):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (pip install 'disttrain[fp8]')")
    _mock_cuda(monkeypatch, [(8, 9), (9, 0)])  # an L4 and an H100
    cfg = load_config(None, [*FP8, "--parallel.nproc=2", '--train.fp8_recipe="rowwise"'])
    assert (cfg.train.precision, cfg.train.fp8_recipe) == ("fp8", "rowwise")


def test_missing_torchao_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(fp8_rules.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        fp8_rules.check_torchao()
    assert "pip install 'disttrain[fp8]'" in one_line(err)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # the import fails (not installed)
    monkeypatch.setenv(fp8_rules.EMULATE_ENV, "1")
    with pytest.raises(UserError) as err:
        apply_fp8(GPT(TINY))
    assert "pip install 'disttrain[fp8]'" in one_line(err)


def _signature(model: nn.Module) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in dt.unwrap(model).state_dict().items()}


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    x = torch.randint(0, 256, (2, TINY.block_size + 1), generator=torch.Generator().manual_seed(seed))
    logits, loss = model(x[:, :-1], x[:, 1:])
    assert logits.dtype == torch.float32  # the model hands fp32 outputs back, as under bf16
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _wrapped(precision: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = dt.wrap(GPT(TINY), precision=precision)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_emulated_fp8_converts_the_eligible_linears_and_checkpoints_resume_in_bf16_and_back(tmp_path, monkeypatch):
    """One run shows the conversion, the unchanged state dict and both resumes."""
    pytest.importorskip("torchao.float8")
    monkeypatch.setenv(fp8_rules.EMULATE_ENV, "1")
    fp8, fp8_opt = _wrapped("fp8")
    converted = {n for n, m in fp8.named_modules() if type(m).__name__ == "Float8Linear"}
    layers = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")
    assert converted == {f"blocks.{i}.{n}" for i in range(2) for n in layers}
    assert type(fp8.lm_head) is nn.Linear and fp8.lm_head.weight is fp8.tok_emb.weight  # tied head stays bf16
    assert not fp8_rules.converts(nn.Linear(10, 16)) and not fp8_rules.converts(nn.Linear(16, 24))
    bf16, bf16_opt = _wrapped("bf16")
    assert _signature(fp8) == _signature(bf16)  # names, shapes and fp32 dtypes: the plain model's
    loss = _step(fp8, fp8_opt, seed=1)
    assert abs(loss - _step(*_wrapped("bf16"), seed=1)) < 0.05  # the same first step, in float8
    dt.save(TrainState(model=fp8, optimizer=fp8_opt, step=1), tmp_path / "run")
    assert dt.load(TrainState(model=bf16, optimizer=bf16_opt), tmp_path / "run") is not None
    assert all(torch.equal(a, b) for a, b in zip(fp8.state_dict().values(), bf16.state_dict().values(), strict=True))
    assert bf16_opt.state_dict()["state"][0]["step"] == 1  # the optimizer state came along
    _step(bf16, bf16_opt, seed=2)
    dt.save(TrainState(model=bf16, optimizer=bf16_opt, step=2), tmp_path / "run")
    back, back_opt = _wrapped("fp8")
    state = TrainState(model=back, optimizer=back_opt)
    dt.load(state, tmp_path / "run")
    assert state.step == 2
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), bf16.state_dict().values(), strict=True))


def test_fp8_computes_the_rest_in_bf16_and_needs_no_scaler():
    with dt.autocast("fp8"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert dt.make_grad_scaler("fp8") is None


def test_planner_fp8_drops_the_16_bit_weight_copies_and_adds_one_layers_float8_scratch():
    """DDP: autocast made a 2-byte copy of every weight; fp8's converted layers cast their
    own (the 12 h^2 of each block's four matrices), and one layer at a time holds float8
    copies of its weight, input and output gradient (the MLP's: 4 h^2 + tokens x 5 h)."""
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
    spec = from_gpt_config(cfg)
    h, tokens = cfg.n_embd, 4 * cfg.block_size
    converted = cfg.n_layer * 12 * h * h
    scratch = 4 * h * h + tokens * 5 * h
    total = {}
    for precision in ("bf16", "fp8"):
        work = Workload(precision=precision, batch_per_device=4, seq_len=cfg.block_size)
        total[precision] = {v: memory(spec, work, 2, Variant(v)).total for v in ("ddp", "zero1", "fsdp_full")}
    assert total["bf16"]["ddp"] - total["fp8"]["ddp"] == 2 * converted - scratch
    assert total["bf16"]["zero1"] - total["fp8"]["zero1"] == 2 * converted - scratch
    assert total["fp8"]["fsdp_full"] - total["bf16"]["fsdp_full"] == scratch  # bf16 all-gathers either way
