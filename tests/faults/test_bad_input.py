"""Issue 22, the commands' side: what a user types gets one line and exit 2 (or works),
never a traceback, and nothing they had is overwritten. Items 7 (no orphan workers),
10 (commands that write, counts, sizes), 11 (Slurm launch files), 12 (messages).
"""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import ROOT, WORKERS, run_disttrain, worker_env

from disttrain.cli import main as cli
from disttrain.launch.end_lines import others_clause as _others

pytestmark = pytest.mark.timeout(180)

TINY_TOML = "[train]\nout_dir = \"{out}\"\n"


def _one_line_error(capsys, *argv) -> str:
    rc = cli(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_10_commands_that_write_refuse_unwritable_or_existing_paths(tmp_path, capsys):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    under_a_file = str(keep / "x.png")
    assert "is a file" in _one_line_error(capsys, "plan", "--params", "1B", "--png", under_a_file)
    assert "already exists" in _one_line_error(capsys, "plan", "--params", "1B", "--png", str(keep))
    cfg = tmp_path / "job.toml"
    cfg.write_text(TINY_TOML.format(out=tmp_path / "out"))
    assert "already exists" in _one_line_error(capsys, "launch-file", "slurm", str(cfg), "--nodes", "1",
                                               "-o", str(keep))
    assert "is a file" in _one_line_error(capsys, "launch-file", "slurm", str(cfg), "--nodes", "1",
                                          "-o", str(keep / "job.sbatch"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert "is a file" in _one_line_error(capsys, "report", str(run), "--out", under_a_file)
    not_a_png = tmp_path / "k.png"
    not_a_png.write_bytes(b"not a png")
    assert "already exists" in _one_line_error(capsys, "report", str(run), "--out", str(not_a_png))
    assert not_a_png.read_bytes() == b"not a png"
    assert keep.read_text() == "mine"
    sbatch = tmp_path / "job.sbatch"  # an earlier launch file of its own is replaced
    for _ in range(2):
        assert cli(["launch-file", "slurm", str(cfg), "--nodes", "1", "-o", str(sbatch)]) == 0
    capsys.readouterr()
    script = str(ROOT / "examples" / "plain_to_ddp.py")
    assert "already exists" in _one_line_error(capsys, "doctor", script, "-o", str(keep))
    assert "is a directory" in _one_line_error(capsys, "doctor", script, "-o", str(tmp_path))
    assert keep.read_text() == "mine"
    for form in ("text", "json", "sarif"):  # an earlier report of its own is replaced
        report = tmp_path / f"doctor.{form}"
        for _ in range(2):
            assert cli(["doctor", script, "--format", form, "-o", str(report)]) == 0, capsys.readouterr().err


def test_10_counts_and_sizes_that_cannot_work_are_one_line(capsys):
    assert "--nproc is 'abc'" in _one_line_error(capsys, "run", "--nproc", "abc", "x.py")
    assert "--nnodes is '0'" in _one_line_error(capsys, "run", "--nnodes", "0", "x.py")
    assert "65,536" in _one_line_error(capsys, "plan", "--params", "7B", "--devices", "100000000")


@pytest.mark.parametrize("flags, words", [
    (["--time", "25:99:99"], "is not a Slurm time limit"),
    (["--time", "0"], "is no time at all"),
    (["--time", "1"], "not longer than"),
    (["--partition", "gpu\n#SBATCH --account=other"], "contains a newline"),
    (["--partition", "gpu;rm"], "is not a Slurm partition name"),
])
def test_11_slurm_time_and_partition_are_checked(tmp_path, capsys, flags, words):
    cfg = tmp_path / "job.toml"
    cfg.write_text(TINY_TOML.format(out=tmp_path / "out"))
    out = tmp_path / "job.sbatch"
    assert words in _one_line_error(capsys, "launch-file", "slurm", str(cfg), "--nodes", "2", *flags,
                                    "-o", str(out))
    assert not out.exists()


def test_11_valid_slurm_times_pass(tmp_path):
    from disttrain.launch.launch_files import slurm_seconds

    assert [slurm_seconds(t) for t in ("90", "30:00", "04:00:00", "1-00", "1-02:03", "1-02:03:04")] == \
           [5400, 1800, 14400, 86400, 93780, 93784]


def test_12_report_says_what_is_wrong_with_the_run_directory(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "is a file, not a run directory" in _one_line_error(capsys, "report", str(a_file))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("garbage\n{not json\n")
    assert "no metrics record in its 2 line(s)" in _one_line_error(capsys, "report", str(run))
    lines = [{"step": 1, "loss": 3.0, "attempt": 1}, "garbage", {"step": 2, "loss": 2.5, "attempt": 1},
             {"step": 2}, {"step": 3, "loss": 2.0, "attempt": 1}]
    (run / "metrics.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    from disttrain.report.report_command import report

    side = report(run)
    assert side["skipped_lines"] == [2, 4] and side["attempts"] == 1  # a bad line is no restart
    assert any("skipped" in what for what, _ in side["table"])


def test_12_ranks_the_launcher_stopped_are_not_named_as_failed():
    fail = lambda code: SimpleNamespace(exitcode=code)  # noqa: E731
    assert _others({1: fail(3), 0: fail(-signal.SIGTERM)}, 1, []) == \
        " (ranks [0] were stopped by the launcher after that)"
    assert _others({1: fail(3), 2: fail(1), 0: fail(-signal.SIGTERM)}, 1, []) == \
        " (also failed: ranks [2]; ranks [0] were stopped by the launcher after that)"
    assert _others({1: fail(-9), 2: fail(1), 0: fail(1)}, 1, [0]) == \
        " (also failed: ranks [2]; ranks [0] lost their peer after that)"
    assert _others({1: fail(3)}, 1, []) == ""


SLEEPER = """
import os, sys, time
open(sys.argv[1] + "." + os.environ["RANK"], "w").write(str(os.getpid()))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_7_workers_die_with_a_killed_launcher(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    marker = tmp_path / "pid"
    launcher = subprocess.Popen([sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2", str(script),
                                 str(marker)], env=worker_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(f"{marker}.{r}") for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        pids = [int(open(f"{marker}.{r}").read()) for r in range(2)]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, pids)), f"orphan workers {pids} outlived their launcher"
    finally:
        for r in range(2):
            try:
                os.kill(int(open(f"{marker}.{r}").read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_3_cli_refuses_a_checkpoint_dir_that_is_a_file_before_any_worker(tmp_path):
    a_file = tmp_path / "ckpt"
    a_file.write_text("keep me")
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", "--parallel.nproc=2", f"--checkpoint.dir={a_file}",
                          f"--train.out_dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and a_file.read_text() == "keep me"
    assert not (tmp_path / "run").exists()


def test_ckpt_commands_say_that_a_folder_does_not_exist(tmp_path, capsys):
    """A mistyped folder was said to hold "no committed checkpoint", which sent a user
    looking for a damaged checkpoint instead of at the path."""
    for missing in (tmp_path / "runs" / "x" / "checkpoints", tmp_path / "step-00000004"):
        for action in ("inspect", "verify", "export"):
            err = _one_line_error(capsys, "ckpt", action, str(missing), "--to", str(tmp_path / "m.safetensors"))
            assert f"{missing} does not exist" in err and "no committed checkpoint" not in err, err
    assert not (tmp_path / "m.safetensors").exists()


def test_10_doctor_analyses_a_3000_term_expression(tmp_path, capsys):
    script = tmp_path / "long.py"
    script.write_text("import torch\nx = " + " + ".join(["a"] * 3000) + "\n")
    assert cli(["doctor", str(script)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_12_doctor_refuses_a_folder_without_python_files(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no scripts here")
    assert "no Python files in this folder" in _one_line_error(capsys, "doctor", str(tmp_path))


def test_12_doctor_reads_a_bom_and_a_latin1_coding_line_as_python_does(tmp_path, capsys):
    latin = tmp_path / "latin.py"
    latin.write_bytes('# -*- coding: latin-1 -*-\nimport torch\nname = "r\xe9sum\xe9"\n'.encode("latin-1"))
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfimport torch\nx = 1\n")
    assert cli(["doctor", str(latin), str(bom)]) == 0, capsys.readouterr().err


def test_6_a_python_level_hang_is_named_by_the_stacks():
    from disttrain.guard.hang_report import diagnose

    def beat(rank):
        return {"rank": rank, "step": 5, "phase": "step", "state": "running", "alive": 100.0,
                "counts": {"step": 5}, "history": {"step": [5]}}

    waiting = ('Thread 1 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
               '    step (disttrain/train/job.py:200)\n    <module> (train.py:39)\n')
    looping = 'Thread 1 (active): "MainThread"\n    spin (train.py:12)\n    <module> (train.py:39)\n'
    beats = [beat(0), beat(1)]
    verdict, lagging = diagnose(beats, 101.0, 3)
    assert lagging == [] and "communication problem" in verdict  # the heartbeats alone cannot tell
    verdict, lagging = diagnose(beats, 101.0, 3, stacks={0: waiting, 1: looping})
    assert lagging == [1] and "rank(s) [1] are not in a collective" in verdict and "spin (train.py:12)" in verdict
    assert diagnose(beats, 101.0, 3, stacks={0: waiting, 1: waiting})[1] == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stuck", [0, 1])
def test_6_a_plain_script_hang_names_the_rank_that_stopped(stuck):
    """A plain DDP script (no dt.Job) under `disttrain run`: one rank sleeps in its own
    code while the other waits in the backward's all-reduce. The script watchdog reports
    (run_disttrain's 200 s, far under gloo's 30 min timeout), names the stuck rank and its
    line, and the job stops with 124."""
    proc = run_disttrain(["run", "--nproc", "2", "--hang-timeout", "6", str(WORKERS / "plain_hang.py"),
                          str(stuck)], timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 124, out[-3000:]
    assert f"Lagging rank(s): {stuck}." in out, out[-3000:]
    assert "wait_for_a_lock_that_never_comes (plain_hang.py" in out, out[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"disttrain run: the job hung and was stopped (exit status 124): rank {stuck} stopped "
                           "making progress, as the guard's summary above says"), last  # the summary's verdict
    assert "Traceback" not in out, out[-3000:]


def test_6_hang_timeout_is_checked_before_any_worker():
    proc = run_disttrain(["run", "--nproc", "2", "--hang-timeout", "soon", str(WORKERS / "plain_hang.py"), "1"])
    assert proc.returncode == 2 and "--hang-timeout" in proc.stderr and "'soon'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_6_job_takes_over_from_the_script_watchdog(tmp_path, monkeypatch):
    """The script watchdog halts at Job's start_guard: in the same side channel its
    heartbeat stays for the successor; with the guard off it stops, and the last rank
    to stop removes the side channel."""
    import tempfile

    from disttrain.guard import script_watchdog as sw
    from disttrain.guard.watchdog import default_dir
    from disttrain.runtime.processes import STATE

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("DISTTRAIN_HANG_TIMEOUT_S", "30")
    for successor in (default_dir(), None):
        monkeypatch.setattr(STATE, "watchdog", None)
        wd = sw.start_for_script()
        assert wd is not None and wd._thread.is_alive() and sw.start_for_script() is None
        sw.hand_over(successor)
        assert wd._thread is None and STATE.watchdog is None
        beat = default_dir() / "hb0.json"
        assert json.loads(beat.read_text())["state"] == "running" if successor else not beat.exists()
    monkeypatch.setenv("DISTTRAIN_HANG_TIMEOUT_S", "0")
    assert sw.start_for_script() is None
