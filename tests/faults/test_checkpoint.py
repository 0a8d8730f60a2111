"""Checkpoints across real gloo ranks under torchrun: exact resume in a new process
group, async == sync, ENOSPC, resharding between strategies and world sizes, and
kill -9 at every stage of a save (P-CKPT-1,2,3,5, P-FSDP-8, P-ELASTIC-3,6).

Launches: save (w=2), reshard (w=4), resume (w=2), and three crash jobs run side by
side. Everything else is asserted here from their JSON and directories.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, built_once, launch_worker, run_cmd, worker_env

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, full_state, mismatches, train  # noqa: E402

import disttrain as dt  # noqa: E402
from disttrain.checkpoint import Checkpointer, latest_valid  # noqa: E402


def _phase(out: Path, phase: str, world: int) -> list[dict]:
    return launch_worker("ckpt_checks.py", world, out, phase, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return built_once(tmp_path_factory, "ckpt-runs", _runs)


def _runs(out: Path):
    single = build("ddp")  # world 1: a plain module
    train(single, 3)
    dt.save(single, out / "R1")
    torch.save(full_state(single), out / "ref_R1.pt")
    save = _phase(out, "save", 2)
    reshard = _phase(out, "reshard", 4)
    resume = _phase(out, "resume", 2)
    return out, save, reshard, resume


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_exact_resume_in_a_new_process_group_P_CKPT_1(runs, strategy):
    _, save, _, resume = runs
    for s, r in zip(save, resume, strict=False):
        assert s[f"{strategy}_first_losses"] == s[f"{strategy}_ref_losses"][:3]
        assert r[f"{strategy}_loaded"] == "step-00000003" and r[f"{strategy}_step"] == 3
        # dropout on, shuffled data: per-step losses after the resume are bit-identical
        assert r[f"{strategy}_resumed_losses"] == s[f"{strategy}_ref_losses"][3:]
    assert resume[0][f"{strategy}_mismatch"] == []  # parameters and optimizer, bit for bit


def test_retention_keeps_last_k_after_the_newer_commit(runs):
    for s in runs[1]:
        assert s["ddp_dirs"] == s["fsdp_dirs"] == ["step-00000002", "step-00000003"]


def test_thread_async_save_equals_sync_bit_for_bit(runs):
    _, save, _, resume = runs
    assert all(s["async_returned"] and s["async_dir"] == "step-00000002" for s in save)
    assert resume[0]["async_vs_sync"] == []
    assert all(r["async_meta_equal"] for r in resume)


def test_disk_full_fails_cleanly_on_every_rank(runs):
    for s in runs[1]:
        assert "disk full" in s["enospc_error"] and "step-00000004 stays the latest" in s["enospc_error"]
        assert s["enospc_latest"] == "step-00000004" and s["enospc_leftovers"] == []
        assert s["enospc_then_trained"]  # the process group still works: training continues


def test_reshard_fsdp4_to_ddp2_to_single_P_FSDP_8(runs):
    out, _, reshard, resume = runs
    assert resume[0]["R4_as_ddp_mismatch"] == [] and resume[0]["R4_keys"] > 20
    single = build("ddp")
    dt.load(single, out / "R2")
    assert mismatches(full_state(single), torch.load(out / "ref_R4.pt", weights_only=True)) == []


@pytest.mark.parametrize("victim", [0, 1])
def test_a_corrupt_shard_of_either_rank_fails_the_load_on_every_rank_P_CKPT_5(runs, victim):
    """Each rank hashes only its share of the files on load; the ranks agree."""
    resume = runs[3]
    message = resume[0][f"corrupt_{victim}"]
    assert f"__{victim}_0.distcp fails its xxh3_128 checksum" in message and "Refusing to load" in message
    assert all(r[f"corrupt_{victim}"] == message for r in resume)


def test_reshard_single_to_fsdp4_P_FSDP_8(runs):
    reshard = runs[2]
    assert reshard[0]["R1_mismatch"] == [] and reshard[0]["R1_keys"] > 20


POINTS = {"shards": "kill@checkpoint.shards:rank=1,step=2",
          "after_shards": "kill@checkpoint.after_shards:rank=0,step=2",
          "during_commit": "kill@checkpoint.during_commit:rank=0,step=2"}


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """Three jobs killed (SIGKILL) at each stage of saving step 2, run side by side."""
    return built_once(tmp_path_factory, "ckpt-crashes", _crashes)


def _crashes(tmp: Path):
    jobs = {}
    for name, fault in POINTS.items():
        out = tmp / f"crash_{name}"
        out.mkdir()
        cmd = run_cmd(2, str(WORKERS / "ckpt_checks.py"), str(out), "crash")
        jobs[name] = (out, subprocess.Popen(cmd, env=worker_env(DISTTRAIN_FAULT=fault),
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = {}
    for name, (out, proc) in jobs.items():
        try:
            log = proc.communicate(timeout=180)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"crash job {name} hung")
        results[name] = (out / "crash", proc.returncode, log)
    return results


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_9_during_save_leaves_previous_latest_P_CKPT_2(crashes, point):
    root, rc, log = crashes[point]
    assert rc != 0 and "disttrain fault: kill" in log, log[-2000:]
    assert not (root / "step-00000002").exists()
    assert latest_valid(root).name == "step-00000001"
    # it loads (at world 1: resharded) and training resumes and checkpoints again
    state = build("ddp")
    ck = Checkpointer(root, keep_last=3)
    assert ck.load(state).name == "step-00000001" and state.step == 1
    train(state, 1)
    assert ck.save(state).name == "step-00000002"
    assert latest_valid(root).name == "step-00000002"
    assert not list(root.glob(".tmp-*"))  # the dead writer's leftovers were pruned
