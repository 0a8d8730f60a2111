"""Keep the benchmark suite from rotting: cheap unit checks of its parts, one quick
run of a small subset of `python -m bench`, and the CPU dry run of bench/gpu.sh.

No timing is asserted: the benchmarks report targets, tests only check that the
suite runs and writes what it promises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, built_once, worker_env

sys.path.insert(0, str(ROOT))

from bench import code_diff, common, report  # noqa: E402
from bench.matrix import WORKLOADS  # noqa: E402


def test_summary_is_median_min_max():
    assert common.summary([3.0, 1.0, 2.0, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert common.fmt(common.summary([1.0, 2.0, 4.0]), digits=1) == "2.0 (1.0-4.0)"
    assert common.summary([]) == {}


def test_code_diff_ignores_comments_docstrings_and_indentation():
    plain = '"""doc"""\nx = 1\nfor i in range(3):\n    f(i)  # call\n'
    converted = '"""other doc"""\nimport dt\nx = 1\nwith dt.ctx():\n    for i in range(3):\n        f(i)\n'
    counts = code_diff.diff_counts(plain, converted)
    assert (counts["added"], counts["removed"]) == (2, 0)


def test_every_workload_converts_plain_and_parses():
    files = {name: spec[0] for name, spec in WORKLOADS.items() if name != "plain"}
    counts = code_diff.count_all(files)
    for name, c in counts.items():
        assert c["changed"] > 0, name
    # One word differs between the two disttrain scripts: the strategy.
    ddp = code_diff.diff_counts((common.WORKLOADS / "disttrain_ddp.py").read_text(),
                                (common.WORKLOADS / "disttrain_fsdp.py").read_text())
    assert (ddp["added"], ddp["removed"]) == (1, 1)


def test_report_merges_other_results(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "checkpoint.md").write_text("| save | 1 GB/s |\n")
    (results / "guard_overhead.md").write_text("## Guard overhead\n\nsmall\n")
    path = report.write(common.Options(out_dir=tmp_path), [])
    text = path.read_text()
    assert "## 5. Checkpoints" in text and "| save | 1 GB/s |" in text
    assert "## 6. Recovery" in text and "Pending" in text
    assert "## Guard overhead" in text
    assert "/tmp" not in text and "/work" not in text


@pytest.mark.timeout(240)
def test_quick_subset_writes_benchmarks(tmp_path):
    """`python -m bench --quick` on the cheapest jobs: one repeat of the DDP pair."""
    cmd = [sys.executable, "-m", "bench", "--quick", "--repeats", "1", "--steps", "2",
           "--sections", "overhead", "--only", "torch_ddp,disttrain_ddp", "--no-profile",
           "--output", str(tmp_path)]
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## 1. Overhead against hand-written PyTorch" in text
    assert "Command: `python -m bench --quick" in text and "Preliminary" in text
    data = json.loads((tmp_path / "bench" / "results" / "overhead.json").read_text())
    ddp = next(r for r in data["ratios"] if r["strategy"] == "ddp")
    assert ddp["step_s"]["n"] == 1, data["jobs"]
    assert (tmp_path / "bench" / "results" / "overhead.png").exists()


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


@pytest.fixture(scope="module")
def gpu_dry_run(tmp_path_factory):
    """One CPU dry run of bench/gpu.sh for both tests below: with --fp8 (where torchao is
    installed) it runs the default set's eager pair too, so one call covers every variant."""

    def run(out):
        flags = ["--fp8"] if _has_torchao() else []
        proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), *flags, "--dry-run", str(out)],
                              cwd=ROOT, env=worker_env(PYTHON=sys.executable), capture_output=True,
                              text=True, timeout=450)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return out

    return built_once(tmp_path_factory, "gpu-dry-run", run)


@pytest.mark.timeout(480)
def test_gpu_script_dry_run_on_cpu(gpu_dry_run):
    for variant in ("torch_autocast", "disttrain_fsdp", "disttrain_fsdp_compiled"):
        r = json.loads((gpu_dry_run / f"{variant}.json").read_text())
        assert r["dry_run"] and r["tokens_per_s"] > 0 and 0 <= r["mfu"] < 1
        assert "ckpt_async_stall_s" in r, r.get("ckpt_error")
        assert r["ckpt_gbps"] > 0 and r["ckpt_load_gbps"] > 0 and r["state_bytes"] > 0
        # The parameters were changed between the save and the load: only a load that
        # restored every tensor gives the saved fingerprint back.
        assert r["ckpt_load_exact"] is True, variant
        assert r["sharded"] is False, variant  # like for like: both unsharded at world 1
        assert 0 < r["plan_ddp_gib"] and 0 < r["plan_fsdp_full_gib"], variant
    md = (gpu_dry_run / "gpu.md").read_text()
    assert "| disttrain_fsdp |" in md and "| disttrain_fsdp_compiled |" in md and "save GB/s" in md
    assert "| raw disk (write + fsync, cold read) |" in md and "load GB/s" in md
    assert "disttrain compiled MFU:" in md and "goal: 40%" in md
    import torch

    assert f"\ntorch {torch.__version__}\n" in md  # the release it ran on, for the README


@pytest.mark.timeout(480)
def test_gpu_script_fp8_dry_run_on_cpu(gpu_dry_run):
    """`bench/gpu.sh --fp8`: bf16 and fp8 through disttrain and fp8 by hand with torchao,
    all compiled, disttrain's checkpoints and the raw disk in one call (fp8 emulated)."""
    if not _has_torchao():
        pytest.skip("torchao is not installed (pip install 'disttrain[fp8]')")
    r = {v: json.loads((gpu_dry_run / f"{v}.json").read_text())
         for v in ("disttrain_fsdp_compiled", "disttrain_fp8_compiled", "torchao_fp8_compiled")}
    assert r["disttrain_fsdp_compiled"]["precision"] == "bf16"
    assert r["disttrain_fsdp_compiled"]["raw_write_gbps"] > 0  # the raw disk beside the checkpoint
    # like for like: the same layers in float8 both ways, the same loss within the goal
    ours, hand = r["disttrain_fp8_compiled"], r["torchao_fp8_compiled"]
    assert ours["precision"] == hand["precision"] == "fp8"
    assert ours["fp8_layers"] == hand["fp8_layers"] == 12  # q, k, v, proj, 2 MLP x 2 blocks, not the tied head
    assert abs(ours["loss"] - r["disttrain_fsdp_compiled"]["loss"]) < 0.01 * r["disttrain_fsdp_compiled"]["loss"]
    assert ours["ckpt_load_exact"] is True and "state_bytes" not in hand
    md = (gpu_dry_run / "gpu.md").read_text()
    assert "disttrain_fsdp_compiled against the raw disk, same machine and call: save" in md
    for verdict in ("disttrain / hand-written tokens/s (fp8 compiled)", "fp8 / bf16 tokens/s", "fp8 loss after"):
        assert verdict in md, verdict


def test_product_ab_switches_are_trainer_keys_and_both_sides_do_the_same_work():
    """Every A/B variant's switches load as a config; the hand-written loop reads the
    same model, batch, steps and cadence as the trainer."""
    from bench.matrix import workload_env
    from disttrain.config import load_config

    sys.path.insert(0, str(common.WORKLOADS))
    import train_spec

    hand = train_spec.config()
    for name in [n for n in WORKLOADS if WORKLOADS[n][0] == "trainer_run.py"]:
        os.environ["BENCH_TRAIN_ARGS"] = workload_env(name).get("BENCH_TRAIN_ARGS", "")
        try:
            cfg = load_config(train_spec.CONFIG, train_spec.overrides())
        finally:
            del os.environ["BENCH_TRAIN_ARGS"]
        for section, key in [("model", "block_size"), ("model", "n_layer"), ("train", "batch_size"),
                             ("train", "steps"), ("train", "eval_every"), ("checkpoint", "every")]:
            assert getattr(getattr(cfg, section), key) == hand[section][key], (name, section, key)
    assert train_spec.step_seconds({10: 1.0, train_spec.STEPS: 1.0 + train_spec.TIMED * 0.5}) == 0.5


def _job(name, times):
    from bench.matrix import JobResult

    return JobResult(name, 2, [{"repeat": i, "step_s": t, "cpu_s": t / 2, "rss_mb": 300.0}
                               for i, t in enumerate(times)])


def test_product_section_shares_come_from_paired_repeats():
    from bench import guard_overhead as product

    class FakeMatrix:
        jobs = {"hand_train": [1.0, 2.0], "dt_train": [1.1, 2.2], "dt_train_no_guard": [1.0, 2.0]}

        def get(self, name, world):
            return _job(name, self.jobs.get(name, [1.0, 2.0]))

    data = product.analyse(FakeMatrix(), common.Options())
    assert round(data["ratio"]["step_s"]["median"], 6) == 1.1 and data["ratio"]["step_s"]["n"] == 2
    assert round(data["shares"][0]["ratio"]["cpu_s"]["median"], 6) == 1.1  # guard on / off
    text = product.render({**data, "command": "python -m bench"})
    assert "wall **MISSED** (1.100" in text and "CPU **MISSED**" in text and "+10.0 %" in text
    assert "+10.0 %" in product.guard_md({**data, "command": "python -m bench"})


def test_memory_checks_compare_grad_op_and_full_peaks_and_the_plan():
    from bench import memory

    rows = [{"spec": "fsdp:full", "world": 2, "peak": 100, "plan_error": 0.1},
            {"spec": "fsdp:grad_op", "world": 2, "peak": 120, "plan_error": -0.3}]
    text = " ".join(memory.checks(rows))
    assert "w=2" in text and "**met** (0.00" in text  # grad_op above full
    assert "**MISSED** (worst -30.0%, fsdp:grad_op" in text
    rows[1]["peak"] = 90
    assert "fsdp:full at w=2 (it keeps every gathered parameter from forward to backward): **MISSED**" \
        in " ".join(memory.checks(rows))
    assert memory.plan_bytes("fsdp:grad_op", 2) > memory.plan_bytes("fsdp:full", 2) > 0


def test_tp_report_gives_the_ratio_its_noise_and_the_planner_against_the_ranks():
    from bench import tp_bench, tp_report

    times = {name: [[0.2, 0.3], [0.4, 0.5]] for name in tp_bench.LAYOUTS}
    times["disttrain tp2 x dp2"] = [[0.202, 0.303], [0.404, 0.505]]  # 1.01x in every turn
    rank = {name: {"params": 10, "grads": 10, "optim": 20, "activations": 100} for name in tp_bench.LAYOUTS}
    data = {"times": times, "memory": [rank] * 4, "command": "python bench/tp_bench.py",
            "comms": {name: {"fwd": 8, "bwd": 16} for name in tp_bench.LAYOUTS},
            "machine": {"cores": 2, "cpu": "cpu", "torch": "2", "date": "today", "load_1min": 1.0}}
    text = tp_report.render(data, model=tp_bench.MODEL, world=4, global_batch=16, layouts=tp_bench.LAYOUTS)
    assert "| **1.010** | 1.010 (1.01-1.01) | 1.01, 1.01 | <= 1.02 |" in text
    assert "| **1.000** | 1.000 (1.00-1.00) | 1.00, 1.00 | (1.00) |" in text  # the control
    assert "| tp4 x dp1 | params | 944 KiB | 10 B |" in text  # the planner's row, the worst rank's
    assert "| disttrain tp2 x dp2 | 8 (8) | 16 (16) |" in text  # the GPT's 4 blocks: 2 and 4 each
    assert "| disttrain tp1 x dp4 | 8 (0) | 16 (0) |" in text  # tp 1 plans none
