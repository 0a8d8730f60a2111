"""Tests of `disttrain plan`: predicted bytes against real gloo runs, rules, errors, CLI.

The acceptance test launches tests/plan_workers/measure.py once per world size (1, 2, 4)
with `disttrain run`; the three launches run at the same time because on a small
machine most of their wall time is importing torch and transformers. Each launch
measures DDP, DDP + ZeroRedundancyOptimizer and fully_shard for our GPT and a tiny
Hugging Face GPT-2, and every rank's params + grads + optimizer-state bytes must be
within 5% of `estimate(...)` (they are in fact exact).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import built_once, run_cmd

from disttrain.errors import UserError
from disttrain.plan import advise, estimate, main, model_size, parse_bytes, scaled_lr, warmup_steps

WORKER = Path(__file__).resolve().parents[1] / "plan_workers" / "measure.py"
# vocab 250 and context 66 do not divide by 4: FSDP padding and uneven shards are exercised.
GPT_SPEC = "vocab_size=250,block_size=66,n_layer=2,n_embd=64,n_head=2"
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_layer": 2, "n_embd": 64, "n_head": 2,
             "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}
WORLD_SIZES = (1, 2, 4)
# Shared by the three concurrent launches. A hung collective must fail the test, not the CI
# job; the margin is for loaded 2-core machines (about 40 s when idle, 110 s at load 10).
LAUNCH_TIMEOUT_S = 240
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(TINY_GPT2))
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory, hf_config) -> dict[int, dict]:
    """{world: {"gpt/ddp": [per-rank bytes], ...}} from real gloo process groups."""
    return built_once(tmp_path_factory, "plan-measured", functools.partial(_measure, hf_config))


def _measure(hf_config: Path, tmp: Path) -> dict[int, dict]:
    # find_spec, not import: importing transformers here would cost seconds of serial CPU.
    # Without it our GPT is still measured and the HF cases skip.
    kinds = "gpt,hf" if importlib.util.find_spec("transformers") else "gpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = {}
    for n in WORLD_SIZES:
        out = tmp / f"world{n}.json"
        cmd = run_cmd(n, str(WORKER), str(out), str(hf_config), GPT_SPEC, kinds)
        procs[n] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env, text=True), out)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    results = {}
    try:
        for n, (proc, out) in procs.items():
            try:
                log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"world size {n}: workers did not finish in {LAUNCH_TIMEOUT_S} s (hang?)")
            assert proc.returncode == 0, f"world size {n} failed:\n{log[-4000:]}"
            results[n] = json.loads(out.read_text())
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@functools.cache
def _plan(kind: str, world: int, hf_path: str):
    return estimate(GPT_SPEC if kind == "gpt" else hf_path, devices=world, device_mem="1GiB")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp_full"])
@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_predicted_state_bytes_match_real_ranks(measured, hf_config, kind, strategy, world):
    if f"{kind}/{strategy}" not in measured[world]:
        pytest.skip("transformers is not installed")
    predicted = _plan(kind, world, str(hf_config)).get(strategy).state_per_rank
    actual = measured[world][f"{kind}/{strategy}"]
    assert len(actual) == len(predicted) == world
    for rank, (p, a) in enumerate(zip(predicted, actual, strict=False)):
        for part in ("params", "grads", "optim"):
            assert abs(p[part] - a[part]) <= TOLERANCE * a[part], (rank, part, p, a)
        total_p, total_a = sum(p.values()), sum(a.values())
        assert abs(total_p - total_a) <= TOLERANCE * total_a, (rank, total_p, total_a)


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w % 2 == 0])
def test_predicted_tp_state_bytes_match_real_ranks(measured, hf_config, world):
    """tp 2 x dp world/2 (parallelize_module with the GPT's plan, then fully_shard over dp):
    the TP row's per-rank params, grads and optimizer state are the real ones."""
    predicted = _plan("gpt", world, str(hf_config)).get_tp(2).state_per_rank
    actual = measured[world]["gpt/tp2"]
    # the planner lists the dp ranks; each TP group's ranks hold equal shares
    assert [predicted[r // 2] for r in range(world)] == actual


def test_estimate_uses_the_worst_rank():
    plan = estimate(GPT_SPEC, devices=4)
    z = plan.get("zero1")
    assert z.optim == max(r["optim"] for r in z.state_per_rank)
    assert z.state_bytes == max(sum(r.values()) for r in z.state_per_rank)


# ---------------------------------------------------------------- fit and recommendation


def test_too_big_model_does_not_fit_and_recommends_sharding_or_offload():
    plan = estimate(70e9, devices=8, device_mem="80GiB", seq_len=2048)
    assert plan.get("ddp").fit == "does not fit"
    assert plan.get("zero1").fit == "does not fit"
    assert plan.recommended.startswith("fsdp_full") or "offload" in plan.recommended
    assert plan.get(plan.recommended).fits


def test_nothing_fits_says_so_and_points_at_fsdp_or_offload():
    plan = estimate(2e12, devices=1, device_mem="16GiB", seq_len=2048)
    assert not any(s.fits for s in plan.strategies)
    assert plan.recommended.startswith("fsdp_full") or "offload" in plan.recommended
    assert "nothing fits" in plan.reason


def test_small_model_recommends_ddp():
    plan = estimate(GPT_SPEC, devices=4, device_mem="16GiB")
    assert plan.recommended == "ddp"
    assert "least communication" in plan.reason


def test_communication_ratios():
    plan = estimate(1e9, devices=8)  # a bare count has no padding: exact ratios
    ddp = plan.get("ddp").comm_bytes
    assert ddp == pytest.approx(2 * 7 / 8 * 4e9, rel=1e-6)
    assert plan.get("fsdp_full").comm_bytes / ddp == pytest.approx(1.5)
    assert plan.get("fsdp_grad_op").comm_bytes / ddp == pytest.approx(1.0)
    assert plan.get("zero1").comm_bytes / ddp == pytest.approx(1.5)
    assert all(s.comm_bytes == 0 for s in estimate(1e9, devices=1).strategies)


def test_mixed_precision_adamw_is_16_bytes_per_param_of_state():
    s = estimate(1e9, devices=1, precision="bf16").get("ddp")  # P-FSDP-1
    assert s.params + s.grads + s.optim == pytest.approx(16e9, rel=1e-6)


def test_activation_checkpointing_and_offload_lower_the_peak():
    plan = estimate(1e9, devices=8, batch_per_device=8, seq_len=2048, precision="bf16")
    assert plan.get("ddp+ac").activations < plan.get("ddp").activations
    off = plan.get("fsdp_full+offload")
    assert off.params == off.grads == off.optim == 0 and off.host > 0


# ---------------------------------------------------------------- learning rate (P-LOOP-4)


@pytest.mark.parametrize("batch, expected", [(256, 4.0), (2048, 16.0), (8192, 512 * 8**0.5 / 64)])
def test_lr_rules(batch, expected):
    # base LR tuned at 64: linear to 512, square root from 512 through 4096, flat beyond
    assert scaled_lr(1.0, 64, batch) == pytest.approx(expected)


def test_lr_rule_shape():
    assert scaled_lr(1.0, 256, 4096) / scaled_lr(1.0, 256, 1024) == pytest.approx(2.0)  # sqrt
    assert scaled_lr(1.0, 256, 8192) == scaled_lr(1.0, 256, 4096)  # unchanged beyond 4096
    assert scaled_lr(1.0, 256, 512) == pytest.approx(2.0)  # linear up to 512
    advice = advise(per_device_batch=8, world=32, accum_steps=8, base_lr=3e-4, base_batch=256,
                    total_steps=10_000)
    assert advice.effective_batch == 2048
    assert advice.scaled_lr == pytest.approx(3e-4 * 4)
    assert advice.warmup_steps == 500


def test_warmup():
    assert warmup_steps(10_000) == 500
    assert warmup_steps(1_000_000) == 2000
    assert warmup_steps(10) == 1


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, words", [
    (["--params", "1e9", "--devices", "-2"], "--devices"),
    (["--params", "1e9", "--precision", "fp4"], "--precision"),
    (["--hf", "/nonexistent/config.json"], "no such file"),
    (["--params", "lots"], "--params"),
    (["--params", "1e9", "--device-mem", "80"], "unit"),
    (["--gpt", "n_layers=4"], "n_layer"),
    (["--devices", "2"], "exactly one model"),
])
def test_bad_input_is_a_user_error(argv, words):
    with pytest.raises(UserError, match=words):
        main(argv)


def test_library_validates_too():
    with pytest.raises(UserError, match="--devices"):
        estimate(1e9, devices=-1)
    with pytest.raises(UserError, match="--precision"):
        estimate(1e9, precision="fp64")
    with pytest.raises(UserError, match="--hf"):
        model_size.from_hf_config("/nonexistent/config.json")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("40GB") == 40 * 10**9


# ---------------------------------------------------------------- counting


def test_hf_formula_matches_meta_build(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "tie_word_embeddings": False}
    for cfg in (TINY_GPT2, llama):
        path = tmp_path / f"{cfg['model_type']}.json"
        path.write_text(json.dumps(cfg))
        meta = model_size.from_hf_config(path)
        formula = model_size._hf_formula(model_size._hf_dims(cfg, path), cfg, path)
        assert formula.n_params == meta.n_params
        assert sorted(formula.param_shapes) == sorted(meta.param_shapes)
    assert transformers  # built on meta: nothing was downloaded or allocated
    # Llama's published TP plan: 2 key/value heads allow tp 2, not 4; in backward the input
    # gradients of q, k, v, gate and up are all-reduced, in forward the outputs of o and down
    rows = estimate(str(tmp_path / "llama.json"), devices=4, seq_len=32).tp_rows
    assert [r.tp for r in rows] == [1, 2]
    assert {"tp all-reduce fwd x2/block", "tp all-reduce bwd x5/block"} <= set(rows[1].comm_parts)


def test_toml_config_gives_model_and_defaults(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nn_layer = 2\nn_embd = 64\nn_head = 2\nblock_size = 64\n"
                    "[train]\nbatch_size = 3\nprecision = \"bf16\"\n[parallel]\nnproc = 2\n")
    assert main(["--gpt", str(toml), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    same = estimate("n_layer=2,n_embd=64,n_head=2,block_size=64")
    assert data["model"]["n_params"] == same.model.n_params
    assert data["workload"]["batch_per_device"] == 3 and data["workload"]["precision"] == "bf16"
    assert data["world"] == 2 and data["recommended"] in {s["key"] for s in data["strategies"]}


# ---------------------------------------------------------------- output


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["--params", "7e9", "--devices", "8", "--precision", "bf16", "--png", str(png),
                 "--format", "json"]) == 0
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 300 and height > 200


def test_cli_subprocess_prints_the_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "disttrain.cli", "plan", "--gpt", GPT_SPEC,
                        "--devices", "2", "--device-mem", "1GiB", "--base-lr", "3e-4",
                        "--steps", "1000"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    for text in ("DDP", "ZeRO-1", "FSDP full + offload + AC", "activations", "Recommendation",
                 "effective batch", "warmup 50"):
        assert text in r.stdout


def test_a_toml_with_a_users_model_says_how_to_plan_it():
    """`disttrain plan --gpt tests/byo/byo.toml` (model.factory): one clear line that points
    to --params / --hf, not "unknown GPTConfig key 'factory'"."""
    with pytest.raises(UserError) as caught:
        main(["--gpt", str(Path(__file__).parents[1] / "byo" / "byo.toml"), "--devices", "2"])
    err = str(caught.value)
    assert "factory" in err and "--params" in err and "GPTConfig" not in err
