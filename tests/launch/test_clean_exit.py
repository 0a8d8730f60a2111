"""Every correct script exits under `disttrain run` (warm workers on), whatever it frees
at exit and in whatever order; a rank whose exit is stuck after its code has finished is
ended at the bound and said in one line (runtime/exit_bound.py). Real runs of
tests/workers/clean_exit.py on 2 gloo ranks, each with a timeout: a hang fails the test.

Before: the ddp variant hung after its last line in about one run of three on this
machine (a DDP reducer freeing a destroyed gloo group with the GIL held, while a gloo
thread waited for the GIL to free its last work)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import WORKERS, run_disttrain, worker_env

SCRIPT = str(WORKERS / "clean_exit.py")


def run(variant: str, **env: str) -> subprocess.CompletedProcess:
    try:
        return run_disttrain(["run", "--nproc", "2", SCRIPT, variant], timeout=60, env=worker_env(**env))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{variant}: the job did not end within 60 s: {e.stdout!r}\n{e.stderr!r}")


@pytest.mark.parametrize("variant, times", [("ddp", 2), ("fsdp", 1), ("loader", 1), ("exit0", 1)])
def test_a_correct_script_exits_after_its_last_line(variant, times):
    for _ in range(times):
        proc = run(variant)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.count("last line") == 2
        assert "finished its code but had not exited" not in proc.stderr


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_rank_stuck_at_exit_is_ended_at_the_bound_and_said_in_one_line(warm):
    """A non-daemon thread that never ends: Python itself would wait for it forever.
    With warm workers and without (each worker's entry then watches a forked worker)."""
    proc = run("thread", DISTTRAIN_EXIT_BOUND_S="2", DISTTRAIN_WARM_WORKERS=warm)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stuck = [line for line in proc.stderr.splitlines() if "finished its code but had not exited 2 s later" in line]
    assert sorted(line.split()[3] for line in stuck) == ["0", "1"], proc.stderr[-2000:]
    log = stuck[0].split("its stack at that moment is in ", 1)[1].split(". ", 1)[0]
    with open(log) as f:
        stack = f.read()
    assert "in _shutdown" in stack, stack  # the main thread, waiting for the thread at exit
