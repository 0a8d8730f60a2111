"""Runtime guardrails on real gloo ranks under torchrun (P-DEBUG-1,2,3, P-DATA-1).

Every multi-process case runs under a subprocess timeout, and the hang cases must end
well inside it: the watchdog's test bound is 6 s (generous for a loaded host), far
below the 90 s collective timeout.
"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import WORKERS, built_once, launch_worker, worker_env

from disttrain.config import load_config
from disttrain.errors import ConfigError
from disttrain.guard.hang_report import diagnose
from disttrain.guard.watchdog import HANG_EXIT_CODE
from disttrain.launch import run_command as launch

HANG_TIMEOUT = 100  # seconds for a whole hang job: start-up on a loaded 2-core host dominates


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return built_once(tmp_path_factory, "guard", lambda out: launch_worker("guard_checks.py", 2, out, timeout=150))


def test_rank_with_different_config_is_named_on_every_rank_P_DEBUG_3(checks):
    for res in checks:
        msg = res["config"]
        assert msg.startswith("DistributedMismatchError") and "rank(s) 1 differ" in msg
        assert "optim.lr: rank 0=0.001, rank 1=0.5" in msg
    assert all(res["same"] is None for res in checks)


def test_rank_with_different_model_is_named_on_every_rank_P_DEBUG_3(checks):
    for res in checks:
        msg = res["model"]
        assert "model_structure" in msg and "rank(s) 1 differ" in msg
        assert "rank 0=fc1.weight:(32, 16):float32, rank 1=fc1.weight:(64, 16):float32" in msg


def test_other_fingerprint_fields_are_compared(checks):
    for res in checks:
        assert "dataset_len: rank 0=1000, rank 1=999" in res["field"]


def test_replica_divergence_names_step_and_parameter(checks):
    for res in checks:
        assert res["replicas_ok"] is None
        msg = res["replicas_diverged"]
        assert "by step 3" in msg and "'fc1.bias'" in msg and "rank(s) [1]" in msg


def test_unwrapped_model_at_world_2_warns(checks):
    for res in checks:
        assert "not wrapped by any strategy" in res["unwrapped"]
        assert res["wrapped"] is None


def test_optimizer_over_another_copy_is_an_error(checks):
    for res in checks:
        assert res["optimizer_other_copy"].startswith("NotDistributedError")


def test_same_first_batch_on_every_rank_warns_P_DATA_1(checks):
    for res in checks:
        assert "drew the same first batch" in res["same_batch"]
        assert res["own_batch"] is None
        assert res["strict_same_batch"].startswith("NotDistributedError")


def test_threads_times_ranks_over_cores_warns(checks):
    for res in checks:
        assert "CPU oversubscribed" in res["threads"] and res["threads_ok"] is None


def test_fewer_processes_than_asked_is_an_error(checks, tmp_path):
    for res in checks:
        assert res["world_ok"] is None and "3 processes were asked for" in res["world_short"]
    # The accelerate trap: one plain process while two were asked for (no torchrun env).
    from disttrain.guard import sanity

    with pytest.MonkeyPatch.context() as mp:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            mp.delenv(key, raising=False)
        mp.setenv("DISTTRAIN_EXPECTED_WORLD_SIZE", "2")
        with pytest.raises(sanity.NotDistributedError,
                           match="2 processes were asked for, but no torchrun environment"):
            sanity.check_world_size()


def _detection_seconds(out: str) -> float:
    """How long the stalled step (or silent peer) ran before the watchdog fired."""
    import re

    line = next(line for line in out.splitlines() if "HANG detected" in line)
    return float(re.search(r"(?:has run|no heartbeat for) ([0-9.]+) s", line).group(1))


def _hang_job(tmp_path, mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(WORKERS / "guard_hang.py"), str(tmp_path), mode]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_TIMEOUT, env=worker_env())


def test_stopped_rank_is_named_within_the_bound_P_DEBUG_1(tmp_path):
    proc = _hang_job(tmp_path, "sigstop")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not list(tmp_path.glob("*.done")), out[-3000:]
    assert f"exitcode  : {HANG_EXIT_CODE}" in out
    assert out.count("disttrain guard: HANG detected") == 1, out[-3000:]
    assert "Lagging rank(s): 1." in out and "rank 1 is stopped (SIGSTOP" in out
    assert "guard_hang.py" in out  # the stopped rank's own frame, from its stack dump
    report = (tmp_path / "guard" / "hang_report.txt").read_text()
    assert "--- rank 0 stack ---" in report and "--- rank 1 stack ---" in report
    assert _detection_seconds(out) < 30  # the test cap, far below the 90 s collective timeout


def test_rank_that_skips_a_collective_is_named_P_DEBUG_1(tmp_path):
    proc = _hang_job(tmp_path, "skip")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not list(tmp_path.glob("*.done")), out[-3000:]
    assert "Lagging rank(s): 1." in out, out[-3000:]
    assert "rank 1 skipped phase 'metrics' at step 10" in out
    assert _detection_seconds(out) < 30


def test_diagnose_rules_without_processes():
    def beat(rank, step, phase, **kw):
        return {"rank": rank, "step": step, "phase": phase, "alive": 100.0, "state": "running",
                "history": {}, **kw}

    verdict, lag = diagnose([beat(0, 5, "backward"), beat(1, 4, "data")], 101.0, stale_after=3)
    assert lag == [1] and "behind at step 4" in verdict
    verdict, lag = diagnose([beat(0, 5, "sync"), beat(1, 5, "sync"), beat(2, 5, "data")], 101.0, 3)
    assert lag == [2]
    verdict, lag = diagnose([beat(0, 5, "sync"), beat(1, 5, "sync")], 101.0, 3)
    assert lag == [] and "communication problem" in verdict
    verdict, lag = diagnose([beat(0, 5, "sync"), beat(1, 5, "sync", alive=90.0)], 101.0, 3)
    assert lag == [1] and "not responding" in verdict


def test_ranks_waiting_in_different_collectives_are_a_mismatch_not_the_network():
    """Every rank waits in a collective, but rank 0 in a barrier at line 72 and rank 1 in
    an all_reduce at line 62: the program's collectives do not match (before: "a
    communication problem (network, NCCL ...)")."""
    beats = [{"rank": r, "step": 5, "phase": "sync", "alive": 100.0, "state": "running", "history": {}}
             for r in (0, 1)]

    def waiting(op: str, line: int) -> str:
        return (f'Thread 1 (idle): "MainThread"\n    {op} (torch/distributed/distributed_c10d.py:3252)\n'
                f'    <module> (train.py:{line})\n')

    verdict, lag = diagnose(beats, 101.0, 3, stacks={0: waiting("barrier", 72), 1: waiting("all_reduce", 62)})
    assert lag == [] and "not in the same call" in verdict and "communication problem" not in verdict
    assert "rank 0 in barrier" in verdict and "train.py:72" in verdict and "train.py:62" in verdict
    verdict, lag = diagnose(beats, 101.0, 3, stacks={0: waiting("all_reduce", 62), 1: waiting("all_reduce", 62)})
    assert "communication problem" in verdict  # the same call everywhere: the stacks cannot tell


def test_a_resumed_attempt_starts_with_the_bound_of_the_attempt_before(tmp_path, monkeypatch):
    """Under `disttrain run` (a notes folder), an attempt's typical step time outlives it:
    the next attempt's watchdog bounds its first steps by it, not by `hang_cap_s` (before:
    a resumed attempt waited the whole cap, 240 s by default, before calling a hang)."""
    from disttrain import worker_notes
    from disttrain.guard.watchdog import Watchdog

    monkeypatch.setenv(worker_notes.NOTES_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "1")
    first = Watchdog(hang_factor=20, hang_min_s=5.0, hang_cap_s=240.0)
    assert first.bound() == 240.0  # no steps yet: the cap
    first.durations.extend([0.5, 0.6, 0.7])
    first._note_pace()
    assert first.bound() == 12.0  # 20 x the median
    again = Watchdog(hang_factor=20, hang_min_s=5.0, hang_cap_s=240.0)
    assert again.bound() == 12.0
    monkeypatch.setenv("RANK", "0")  # another rank's pace is not this one's
    assert Watchdog(hang_factor=20, hang_min_s=5.0, hang_cap_s=240.0).bound() == 240.0
    monkeypatch.delenv(worker_notes.NOTES_ENV)  # outside `disttrain run`: nothing kept
    assert Watchdog(hang_factor=20, hang_min_s=5.0, hang_cap_s=240.0).bound() == 240.0


def test_run_debug_sets_backend_switches_P_DEBUG_2(monkeypatch):
    script = str(WORKERS / "hello.py")
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    run = launch.torchrun_for(["--debug", "--nproc", "2", script])
    args, env = run.args, run.env
    assert "--debug" not in args
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL" and env["TORCH_CPP_LOG_LEVEL"] == "INFO"
    assert env["DISTTRAIN_EXPECTED_WORLD_SIZE"] == "2"
    monkeypatch.setattr(launch, "visible_gpus", lambda: 2)  # mocked: no GPU on this machine
    env = launch.torchrun_for(["--debug", "--nproc", "2", script]).env
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,COLL"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    env = launch.torchrun_for(["--nproc", "2", script]).env
    assert "TORCH_DISTRIBUTED_DEBUG" not in env


def test_guard_config_section_is_validated():
    cfg = load_config(None, ["--guard.divergence_every=10", "--guard.hang_cap_s=120"])
    assert cfg.guard.divergence_every == 10 and cfg.guard.enabled
    with pytest.raises(ConfigError, match="hang_factor"):
        load_config(None, ["--guard.hang_factor=0.5"])


def test_diagnose_names_a_skip_older_than_the_kept_history():
    def beat(rank, step, phase, count, last):
        return {"rank": rank, "step": step, "phase": phase, "alive": 100.0, "state": "running",
                "counts": {"metrics": count}, "history": {"metrics": list(range(last - 3, last + 1))}}

    # Rank 1 skipped 'metrics' long ago: it is past rank 0's last entry with one entry fewer.
    verdict, lag = diagnose([beat(0, 39, "metrics", 40, 39), beat(1, 40, "final_barrier", 39, 39)],
                            101.0, stale_after=3)
    assert lag == [1] and "rank 1 skipped phase 'metrics'" in verdict
    # Merely behind (same step, not past rank 0's entry): a lag, not a skip.
    verdict, lag = diagnose([beat(0, 5, "metrics", 6, 5), beat(1, 5, "data", 5, 4)], 101.0, 3)
    assert lag == [1] and "skipped" not in verdict


def test_guard_in_a_world_of_one_is_cheap_and_silent(monkeypatch):
    from disttrain.builtin import MLP, MLPConfig
    from disttrain.config import GuardConfig
    from disttrain.guard import start_guard

    for key in ("WORLD_SIZE", "DISTTRAIN_EXPECTED_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    guard = start_guard(GuardConfig(divergence_every=1), config={"a": 1}, dataset_len=3)
    model = MLP(MLPConfig())
    guard.check_model(model)
    guard.first_batch(torch.zeros(2))
    with guard.phase("eval", slow=True):
        guard.step(1, model)
    assert guard.watchdog is None
    guard.close()


def test_watchdog_cleans_its_side_channel_after_a_clean_run(tmp_path, monkeypatch):
    from disttrain.guard.watchdog import Watchdog

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    wd = Watchdog(dir=tmp_path / "side", tick_s=0.05).start()
    with wd.phase("forward"):
        wd.step(1)
    assert (tmp_path / "side" / "hb0.json").exists()
    wd.stop()
    assert not (tmp_path / "side").exists()


def test_side_channel_survives_a_peers_cleanup_between_mkdir_and_first_file(tmp_path, monkeypatch):
    """The window: `Watchdog.start` made the folder (`self.dir.mkdir`) and then opened
    its first file in it (`stack{rank}.txt`); a peer's `stop` -> `_cleanup`, seeing every
    heartbeat "exited" (rank 0's a stale one, left by the watchdog it handed over from),
    removed the folder in between, and rank 0 died of FileNotFoundError at start-up.
    The peer's cleanup is forced into that window here; rank 0 must start in the
    folder it makes again, and a cleanup that comes after its start keeps the folder."""
    from pathlib import Path

    from disttrain.guard.watchdog import Watchdog

    side = tmp_path / "disttrain-guard-job-29500-r0"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def rank(r: int) -> Watchdog:
        monkeypatch.setenv("RANK", str(r))
        return Watchdog(dir=side, tick_s=0.05)

    rank(0).start().stop()  # rank 0's first watchdog: its beat says "exited"
    peer = rank(1).start()
    real_mkdir, forced = Path.mkdir, []

    def mkdir_then_peer_stops(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self == side and not forced:
            forced.append(True)
            peer.stop()  # every beat now says "exited": the peer removes the folder

    monkeypatch.setattr(Path, "mkdir", mkdir_then_peer_stops)
    successor = rank(0).start()
    try:
        assert forced, "the peer's cleanup never ran inside the window"
        assert successor._thread.is_alive()
        assert json.loads((side / "hb0.json").read_text())["state"] == "running"
        assert (side / "stack0.txt").exists()
        peer = rank(1).start()
        peer.stop()  # rank 0 runs: its beat keeps the folder
        assert json.loads((side / "hb0.json").read_text())["state"] == "running"
    finally:
        successor.stop()
    assert not side.exists()  # both stopped: the last one removed it


def test_side_channel_is_shared_safely_by_ranks_starting_and_stopping_at_once(tmp_path):
    """Real processes, two ranks of one node on one folder, each starting and stopping
    watchdogs in a loop (a rank's handover is a stop and a start): every stop after the
    first ones sees the other rank's stale "exited" beat, so removals meet starts all the
    time, and no start may fail. (A folder removed while both had exited and then made
    again by one rank may stay behind: the last stop removes it only when every local
    rank's beat is there.)"""
    side = tmp_path / "disttrain-guard-job-29501-r0"
    code = ("import sys\n"
            "from disttrain.guard.watchdog import Watchdog\n"
            "for _ in range(300):\n"
            "    Watchdog(dir=sys.argv[1], tick_s=0.05).start().stop()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(side)], stderr=subprocess.PIPE, text=True,
                              env={**worker_env(), "RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
             for r in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    beats = [json.loads(b.read_text()) for b in side.glob("hb*.json")] if side.exists() else []
    assert all(b["state"] == "exited" for b in beats), beats


def test_where_in_stack_reads_py_spy_and_faulthandler_dumps():
    from disttrain.guard.hang_report import where_in_stack

    py_spy = ('Thread 7 (idle): "disttrain-watchdog"\n    _run (disttrain/watchdog.py:9)\n'
              'Thread 1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
              '    global_sum (disttrain/metrics.py:20)\n    <module> (train.py:39)\n')
    assert where_in_stack(py_spy) == ("all_reduce (torch/distributed/distributed_c10d.py:3252), "
                                      "called from global_sum (disttrain/metrics.py:20)")
    faulthandler = ('Thread 0x01 (most recent call first):\n  File "/x/watchdog.py", line 9 in _run\n\n'
                    'Current thread 0x02 (most recent call first):\n'
                    '  File "/v/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward\n'
                    '  File "/w/train.py", line 34 in <module>\n')
    assert where_in_stack(faulthandler).endswith('called from "/w/train.py", line 34 in <module>')


def test_slow_phase_is_bounded_by_its_bytes_and_a_stalled_step_still_fires(tmp_path, monkeypatch):
    """A checkpoint save (or load, or eval) longer than the step bound is not a hang,
    and its time does not count toward the step; a stalled step still is one."""
    import time

    from disttrain.guard.watchdog import Watchdog

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    wd = Watchdog(dir=tmp_path / "side", hang_factor=2, hang_min_s=0.3, hang_cap_s=0.4, tick_s=0.05,
                  warmup_steps=1, slow_min_s=0.2, slow_bytes_per_s=1e6)
    fired: list[str] = []
    wd._fire = fired.append  # record instead of exiting the test process
    wd.start()
    try:
        wd.step(1)
        assert wd.slow_bound(2_000_000) == pytest.approx(0.4 + 2.0)  # floor + bytes / speed
        with wd.slow_phase("checkpoint.save", nbytes=2_000_000):
            time.sleep(1.2)  # 4x the step bound, half the save's bound
            assert wd.bound() == pytest.approx(2.4)
        time.sleep(0.15)  # the step resumes without the save's time
        wd.step(2)
        assert not fired, fired
        assert max(wd.durations) < 0.3
        time.sleep(1.0)  # a stalled step: over the 0.3 s bound
        assert fired and "step 2 on rank 0 has run" in fired[0]
    finally:
        wd.stop()
    wd = Watchdog(dir=tmp_path / "side2", hang_cap_s=0.3, tick_s=0.05, slow_min_s=0.2)
    wd._fire = fired.append
    wd.start()
    try:
        with wd.slow_phase("checkpoint.load", nbytes=0):  # past its own bound: a hang
            time.sleep(0.8)
        assert "slow phase 'checkpoint.load' in step 0 on rank 0 has run" in fired[-1]
    finally:
        wd.stop()
