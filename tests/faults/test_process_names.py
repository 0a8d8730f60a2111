"""Processes named for what they are: during a real 2-rank `disttrain
run`, `ps` names both ranks (/proc/PID/comm, what `ps -e`, top and pgrep show), the
launcher's output gives each rank's pid, and the warm-worker stubs and server are named
as such. Killing the announced pid of rank 1 kills rank 1, not local rank 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cmd, worker_env

from disttrain.runtime import processes

# Each rank says it is up (its pid), then waits for the test's "go" (a file) and exits 0.
SCRIPT = """
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / f"up{os.environ['RANK']}").write_text(str(os.getpid()))
while not (out / "go").exists():
    time.sleep(0.05)
"""
ANNOUNCED = re.compile(r"disttrain run: rank (\d) \(local rank (\d)\) is pid (\d+) \((\S+)\)")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # it ended meanwhile
        return ""


def _children(ppid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            kids.append(int(stat.parent.name))
    return kids


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_name_for_says_the_role_and_fits_the_kernels_name():
    assert processes.name_for("rank", 1, 0) == "rank1.local0"
    assert processes.name_for("stub", 3) == "stub.rank3"
    assert len(processes.name_for("rank", 9999, 7).encode()) <= processes.NAME_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("warm", ["1", "0"])
def test_ps_names_both_ranks_of_a_2_rank_run_and_the_launcher_gives_their_pids(tmp_path, warm):
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        launcher = subprocess.Popen(run_cmd(2, str(script), str(tmp_path)), stdout=subprocess.DEVNULL,
                                    stderr=err, env=worker_env(DISTTRAIN_WARM_WORKERS=warm))
    try:
        _wait_for(lambda: all((tmp_path / f"up{r}").exists() for r in (0, 1)), 120, "both ranks")
        pids = _wait_for(lambda: {int(m[0]): (int(m[1]), int(m[2]), m[3])
                                  for m in ANNOUNCED.findall(stderr.read_text())} if
                         len(ANNOUNCED.findall(stderr.read_text())) == 2 else None, 30, "two pids")
        assert sorted(pids) == [0, 1], stderr.read_text()
        for rank, (local, pid, name) in pids.items():
            assert _comm(pid) == name == f"rank{rank}.local{local}"
            assert (tmp_path / f"up{rank}").read_text() == str(pid)  # the process named rank R is rank R
        others = sorted(_comm(p) for p in _children(launcher.pid))
        # without a warm server each worker's entry forks it and watches it as a stub does
        assert others == (["dt.warm-server", "stub.rank0", "stub.rank1"] if warm == "1"
                          else ["stub.rank0", "stub.rank1"])
        os.kill(pids[1][1], signal.SIGKILL)  # "kill rank 1" by the pid it announced
        assert launcher.wait(timeout=120) != 0
        assert "rank 1 failed first" in stderr.read_text(), stderr.read_text()[-2000:]
    finally:
        (tmp_path / "go").touch()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.slow
def test_fast_recovery_names_its_supervisors_spares_and_training_processes(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    launcher = subprocess.Popen(run_cmd(2, "--fast-recovery", str(script), str(tmp_path)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env())
    try:
        _wait_for(lambda: all((tmp_path / f"up{r}").exists() for r in (0, 1)), 120, "both ranks")
        top = {_comm(p): p for p in _children(launcher.pid)}
        assert sorted(top) == ["dt.warm-server", "slot.rank0", "slot.rank1"]
        want = ["rank0.local0", "rank1.local1", "spare.rank0", "spare.rank1"]  # forked warm
        _wait_for(lambda: sorted(_comm(p) for p in _children(top["dt.warm-server"])) == want, 60, str(want))
        assert sorted(_comm(p) for s in ("slot.rank0", "slot.rank1") for p in _children(top[s])) == \
            ["stub.rank0", "stub.rank0", "stub.rank1", "stub.rank1"]  # the training process's and the spare's
    finally:
        (tmp_path / "go").touch()
        try:
            launcher.wait(timeout=120)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
