"""Issue 49, finding 2: the hang watchdog's side channel on a machine shared with others.

The folder is private to this user and job (0700, files 0600), a folder someone else
made or can write is never used, a planted symlink is never followed, a `stall` left by
an earlier job stops nothing, only the job's own processes are signalled, and the
launcher's folder is gone after the job. "Another user" is uid 65534 (nobody): the
cases that need one run as root and are skipped otherwise.
"""

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import run_disttrain, worker_env

from disttrain.guard import private_dir
from disttrain.guard.private_dir import GUARD_DIR_ENV, UnsafeGuardDir
from disttrain.guard.watchdog import Watchdog
from disttrain.runtime.log import LOGGER

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
JOB_ENV = {"TORCHELASTIC_RUN_ID": "job", "MASTER_PORT": "29555", "TORCHELASTIC_RESTART_COUNT": "0",
           "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}

# A rank's watchdog in its own process; following a stall prints FOLLOWED and exits 124
# at once (the real one waits 30 s for torchrun to stop it).
PROBE = textwrap.dedent("""
    import json, os, sys, time
    from disttrain.guard.watchdog import Watchdog

    class Probe(Watchdog):
        def _follow(self):
            print("FOLLOWED", flush=True)
            os._exit(124)

    wd = Probe(dir=sys.argv[1] or None, tick_s=0.05).start()
    time.sleep(0.5)
    print(json.dumps({"dir": str(wd.dir)}), flush=True)
    if len(sys.argv) > 2:  # a hang of this job, reported by a peer now
        stall = os.path.join(wd.dir, "stall")
        with open(stall + ".new", "w") as f:
            json.dump({"rank": 1, "reason": "now", "time": time.time()}, f)
        os.replace(stall + ".new", stall)
        time.sleep(3)
    wd.stop()
""")


def _probe(tmp_path, dir="", *extra):
    env = {k: v for k, v in worker_env(TMPDIR=str(tmp_path), **JOB_ENV).items() if k != GUARD_DIR_ENV}
    return subprocess.run([sys.executable, "-c", PROBE, str(dir), *extra], capture_output=True, text=True,
                          env=env, timeout=60)


def _give_away(path):
    """`path` and what it holds owned by another user (root only)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("making a folder another user owns needs root (os.chown)")
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, NOBODY, NOBODY)


def _stall(folder, written):
    (folder / "stall").write_text(json.dumps({"rank": 1, "reason": "planted", "time": written}))


def _listing(folder):
    return sorted((p.name, p.stat().st_size) for p in folder.iterdir())


def test_a_folder_another_user_made_at_the_old_name_is_not_used_and_stops_nothing(tmp_path):
    """The name the watchdog used to take (`$TMPDIR/disttrain-guard-<run>-<port>-r<n>`),
    made first by another user, world-writable, with a `stall` in it: the job writes
    nothing there and runs to its end."""
    squatted = tmp_path / "disttrain-guard-job-29555-r0"
    squatted.mkdir()
    _stall(squatted, time.time() + 3600)
    os.chmod(squatted, 0o777)
    _give_away(squatted)
    before = _listing(squatted)
    proc = _probe(tmp_path)
    assert proc.returncode == 0 and "FOLLOWED" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    used = json.loads(proc.stdout.splitlines()[-1])["dir"]
    assert not used.startswith(str(squatted)), used
    assert _listing(squatted) == before


@pytest.mark.parametrize("how", ["another user's", "world-writable"])
@pytest.mark.parametrize("where", ["per-user parent", "launcher's folder"])
def test_a_default_folder_that_is_not_private_turns_the_watchdog_off(tmp_path, monkeypatch, how, where):
    """A default parent folder someone else made or can write: the watchdog stays off
    with a warning, and writes nothing there."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for key, value in JOB_ENV.items():
        monkeypatch.setenv(key, value)
    parent = tmp_path / ("launcher" if where == "launcher's folder" else f"disttrain-guard-u{os.getuid()}")
    parent.mkdir(mode=0o700)
    if where == "launcher's folder":
        monkeypatch.setenv(GUARD_DIR_ENV, str(parent))
    else:
        monkeypatch.delenv(GUARD_DIR_ENV, raising=False)
    if how == "world-writable":
        os.chmod(parent, 0o777)
    else:
        _give_away(parent)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    LOGGER.addHandler(handler)
    try:
        wd = Watchdog(tick_s=0.05).start()
        wd.stop()
    finally:
        LOGGER.removeHandler(handler)
    assert wd._thread is None and list(parent.iterdir()) == []
    assert any("hang watchdog off" in s and str(parent) in s for s in said), said


def test_a_given_folder_that_is_not_private_is_refused(tmp_path):
    """`guard.dir` / `Watchdog(dir=...)` is the user's choice: one UserError line."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafeGuardDir, match="writable by its group or by others"):
        Watchdog(dir=open_dir, tick_s=0.05).start()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(private)
    with pytest.raises(UnsafeGuardDir, match="is a symlink"):
        Watchdog(dir=tmp_path / "link", tick_s=0.05).start()
    assert list(private.iterdir()) == []


def test_symlinks_planted_in_the_folder_are_not_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    side = tmp_path / "side"
    side.mkdir(mode=0o700)
    targets = {name: tmp_path / f"target-{name}" for name in ("stack0.txt", "hb0.tmp", ".lock", "hb1.json")}
    for name, target in targets.items():
        target.write_text(json.dumps({"rank": 1, "pid": os.getpid(), "state": "running", "alive": 0.0,
                                      "host": "h", "step": 0, "phase": "x"}))
        (side / name).symlink_to(target)
    before = {name: t.read_text() for name, t in targets.items()}
    wd = Watchdog(dir=side, tick_s=0.05).start()
    try:
        time.sleep(0.3)
        assert [b["rank"] for b in wd._read_beats()] == [0]  # hb1.json, a symlink, is not read
        assert json.loads((side / "hb0.json").read_text())["state"] == "running"
    finally:
        wd.stop()
    assert {name: t.read_text() for name, t in targets.items()} == before


def test_a_stale_stall_file_does_not_stop_a_new_job_and_a_current_one_does(tmp_path):
    """A `stall` an earlier job left in a reused folder (a shared guard.dir, the same run
    id and port) is ignored; one written during this job is followed."""
    side = tmp_path / "side"
    side.mkdir(mode=0o700)
    _stall(side, time.time() - 3600)
    proc = _probe(tmp_path, side, "then-a-real-hang")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 124 and lines[-1] == "FOLLOWED", proc.stdout + proc.stderr[-3000:]
    assert json.loads(lines[0])["dir"] == str(side)  # it ran past the stale stall first


def test_folder_and_files_are_private_whatever_the_umask(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a peer still to come: the folder stays
    old = os.umask(0)
    try:
        with private_dir.for_launch() as launcher:
            assert os.environ[GUARD_DIR_ENV] == str(launcher)
            wd = Watchdog(tick_s=0.05).start()
            try:
                time.sleep(0.2)
                assert wd.dir.parent == launcher
                modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in wd.dir.iterdir()}
            finally:
                wd.stop()
            assert stat.S_IMODE(launcher.stat().st_mode) == 0o700
            assert stat.S_IMODE(wd.dir.stat().st_mode) == 0o700
        assert {"hb0.json", "stack0.txt", ".lock"} <= set(modes) and set(modes.values()) == {0o600}, modes
    finally:
        os.umask(old)
    assert not launcher.exists() and GUARD_DIR_ENV not in os.environ


def test_a_report_signals_only_the_processes_of_this_job(tmp_path, monkeypatch):
    """A heartbeat naming a process that is not the one that wrote it (another program
    with that pid, here a `sleep`, which SIGUSR1 would kill) is not signalled."""
    monkeypatch.setenv("DISTTRAIN_PY_SPY", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    side = tmp_path / "side"
    stranger = subprocess.Popen(["sleep", "60"])
    wd = Watchdog(dir=side, tick_s=0.05).start()
    if not wd._usr1:  # the report signals this process too (rank 0): only with the handler on
        wd.stop()
        stranger.kill()
        pytest.skip("SIGUSR1 is handled by someone else in this process")
    try:
        beat = {**wd.heartbeat(), "rank": 1, "pid": stranger.pid}
        beat["start"] = 1  # what a forged or stale heartbeat would claim
        (side / "hb1.json").write_text(json.dumps(beat))
        wd._report("a test")
        time.sleep(0.2)
        assert stranger.poll() is None, "the stranger was signalled"
    finally:
        wd.stop()
        stranger.kill()
        stranger.wait(timeout=10)


def test_disttrain_run_hands_its_ranks_a_private_folder_and_removes_it(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""
        import json, os, stat, sys
        folder = os.environ["DISTTRAIN_GUARD_DIR"]
        mode = stat.S_IMODE(os.lstat(folder).st_mode)
        # one write per rank: two ranks' prints share the launcher's stdout
        sys.stdout.write("GUARD " + json.dumps({"rank": os.environ["RANK"], "dir": folder, "mode": mode}) + chr(10))
        sys.stdout.flush()
    """))
    env = {k: v for k, v in worker_env(TMPDIR=str(tmp_path)).items() if k != GUARD_DIR_ENV}
    proc = run_disttrain(["run", "--nproc", "2", str(script)], env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [json.loads(line.split("GUARD ", 1)[1]) for line in proc.stdout.splitlines() if "GUARD " in line]
    assert len(seen) == 2 and len({s["dir"] for s in seen}) == 1, proc.stdout
    assert seen[0]["mode"] == 0o700 and seen[0]["dir"].startswith(str(tmp_path))
    assert not os.path.exists(seen[0]["dir"])
