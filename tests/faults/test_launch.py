"""`disttrain run`: torchrun with a free port, thread defaults and clear failures (P-INIT-4,5)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS, built_once, run_disttrain, worker_env

from disttrain.errors import UserError
from disttrain.launch import end_lines
from disttrain.launch import run_command as launch

SCRIPT = str(WORKERS / "hello.py")


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two `disttrain run` jobs started at once on this host; job 1 without
    OMP_NUM_THREADS in its environment (the launcher's thread default)."""

    def run(out):
        cmd = [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2", SCRIPT]
        envs = [worker_env(), {k: v for k, v in worker_env().items() if k != "OMP_NUM_THREADS"}]
        jobs = [subprocess.Popen(cmd + [str(out / f"job{i}")], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
                for i, env in enumerate(envs)]
        outputs = [job.communicate(timeout=120)[0] for job in jobs]
        return [job.returncode for job in jobs], outputs, out

    return built_once(tmp_path_factory, "two-concurrent-jobs", run)


def test_two_concurrent_jobs_on_one_host_both_succeed_P_INIT_4(two_jobs):
    codes, outputs, out = two_jobs
    assert codes == [0, 0], outputs
    ports = set()
    for i in range(2):
        lines = (out / f"job{i}").read_text().split()
        assert len(lines) == 2  # both ranks of each job reported
        ports |= {line.split(",")[1] for line in lines}
    assert len(ports) == 2  # each job rendezvoused on its own free port


def test_a_scripts_own_exit_status_and_rank_are_reported_and_not_retried(tmp_path):
    """Rank 1 calls sys.exit(3): the program's own exit, reported with its rank and
    status, once, even with restarts left (a restart would exit the same way)."""
    proc = run_disttrain(["run", "--nproc", "2", "--max-restarts", "2", SCRIPT, str(tmp_path / "x"),
                          "--fail-rank", "1"], timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "disttrain run: not retried: rank 1 called sys.exit(3): the program's own exit (exit status 3).")
    assert len((tmp_path / "x").read_text().split()) == 2  # one attempt: each rank wrote once


def test_omp_threads_and_store_defaults(two_jobs):
    codes, outputs, out = two_jobs
    assert codes[1] == 0, outputs[1]
    for line in (out / "job1").read_text().split():
        _, _, threads, share = line.split(",")
        assert threads == str(max(1, __import__("os").cpu_count() // 2)) and share == "1"


def test_missing_script_is_a_clear_error():
    proc = run_disttrain(["run", "--nproc", "2", "no_such_script.py"], timeout=60)
    assert proc.returncode == 2
    assert "script 'no_such_script.py' not found" in proc.stderr and "Traceback" not in proc.stderr


def test_flags_pass_through_and_standalone_only_for_one_node():
    run = launch.torchrun_for(["--nnodes", "1:2", "--rdzv-backend", "c10d",
                                            "--rdzv-endpoint", "127.0.0.1:29400", "--max-restarts",
                                            "3", SCRIPT, "--lr", "1"])
    args, env = run.args, run.env
    assert "--standalone" not in args
    assert args[-3:] == [SCRIPT, "--lr", "1"] and "--max-restarts" in args
    conf = args[args.index("--rdzv-conf") + 1]
    assert "last_call_timeout=2" in conf and "keep_alive_max_attempt=5" in conf
    args = launch.torchrun_for(["--nnodes", "1:2", "--rdzv-backend=etcd", "--rdzv-endpoint",
                                          "127.0.0.1:2379", "--rdzv-conf", "last_call_timeout=7",
                                          SCRIPT]).args
    assert args[args.index("--rdzv-backend") + 1] == "etcd-v2"
    conf = args[args.index("--rdzv-conf") + 1]
    assert "last_call_timeout=7" in conf and "last_call_timeout=2" not in conf
    args = launch.torchrun_for(["--nproc=3", SCRIPT]).args
    assert args[0] == "--standalone" and "--nproc-per-node=3" in args
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_more_processes_than_gpus_refused_mocked_cuda(monkeypatch):
    # Mocked: this machine has no GPU; the check only needs the visible count.
    monkeypatch.setattr(launch, "visible_gpus", lambda: 2)
    with pytest.raises(UserError, match="more processes than the 2 visible GPU"):
        launch.torchrun_for(["--nproc", "4", SCRIPT])
    args = launch.torchrun_for([SCRIPT]).args
    assert args[:3] == ["--standalone", "--nproc-per-node", "2"]


def test_groups_held_past_shutdown_do_not_abort_the_exit():
    """Ranks that still hold a DDP model and a subgroup after `dt.distributed()` ends
    (module globals, as in most scripts) leave through interpreter finalization, where
    torch 2.13's gloo group destructor aborted about one run in two when `dt.shutdown`
    learned to hold such groups ("terminate called without an active exception"). Twelve
    ranks, forked in pairs from one interpreter that has imported torch (one import
    instead of twelve), must each exit 0. With torch 2.13.0's CPU wheel a shutdown
    without the hold exits cleanly too: this guards the exit path, and the hold where the
    destructor still aborts."""
    cmd = [sys.executable, str(WORKERS / "held_group_forks.py"), "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=worker_env())
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "12 ranks exited 0" in proc.stdout and "terminate called" not in proc.stderr


def test_shutdown_timeout_covers_the_preemption_grace(monkeypatch, tmp_path):
    """torchrun SIGKILLs a SIGTERMed worker after --shutdown-timeout (30 s by default),
    so `disttrain run` sets it from the preemption grace; a user's value wins."""
    for key in ("DISTTRAIN_PREEMPT_GRACE_S", *launch.SHUTDOWN_ENV):
        monkeypatch.delenv(key, raising=False)

    def timeout(args):
        return args[args.index("--shutdown-timeout") + 1]

    run = launch.torchrun_for(["--nproc", "2", SCRIPT])
    args, env = run.args, run.env
    assert timeout(args) == str(60 + launch.SHUTDOWN_MARGIN_S) and env["DISTTRAIN_PREEMPT_GRACE_S"] == "60"
    assert args[-1] == SCRIPT
    cfg = tmp_path / "job.toml"
    cfg.write_text("[elastic]\npreempt_grace_s = 100\n")
    run = launch.torchrun_for(["--nproc", "2", "-m", "disttrain.train", str(cfg),
                                            "--elastic.preempt_grace_s=120.5"])
    args, env = run.args, run.env
    assert timeout(args) == str(121 + launch.SHUTDOWN_MARGIN_S) and env["DISTTRAIN_PREEMPT_GRACE_S"] == "120.5"
    assert args[-3:] == ["disttrain.train", str(cfg), "--elastic.preempt_grace_s=120.5"]
    monkeypatch.setenv("DISTTRAIN_PREEMPT_GRACE_S", "7")
    args = launch.torchrun_for(["--nproc", "2", SCRIPT]).args
    assert timeout(args) == str(7 + launch.SHUTDOWN_MARGIN_S)
    args = launch.torchrun_for(["--shutdown-timeout", "5", "--nproc", "2", SCRIPT]).args
    assert args.count("--shutdown-timeout") == 1 and timeout(args) == "5" and args[-1] == SCRIPT
    args = launch.torchrun_for(["--shutdown_timeout=9", SCRIPT]).args
    assert "--shutdown-timeout" not in args and "--shutdown_timeout=9" in args
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "11")
    args = launch.torchrun_for([SCRIPT]).args
    assert "--shutdown-timeout" not in args
    monkeypatch.setenv("DISTTRAIN_PREEMPT_GRACE_S", "soon")
    with pytest.raises(UserError, match="DISTTRAIN_PREEMPT_GRACE_S is 'soon'"):
        launch.torchrun_for([SCRIPT])


def test_a_torchrun_without_shutdown_timeout_is_not_given_one(monkeypatch):
    """torch 2.11's torchrun has no --shutdown-timeout and exits 2 on it (seen on the GPU
    machine's image): the flag is added only where torchrun takes it."""
    for key in launch.SHUTDOWN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(launch, "torchrun_has_shutdown_timeout", lambda: False)
    args = launch.torchrun_for(["--nproc", "2", SCRIPT]).args
    assert "--shutdown-timeout" not in args and args[-1] == SCRIPT


def test_sigterm_to_the_agent_saves_and_exits_zero_without_a_traceback(tmp_path):
    """Kubernetes and Slurm signal the launcher, not the workers: torchrun passes SIGTERM
    on (the workers save and exit 0) and `disttrain run` then exits 0 with one line, where
    plain torchrun raises SignalException and exits 1."""
    import signal
    import time

    cmd = [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2",
           str(WORKERS / "sigterm_saver.py"), str(tmp_path)]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=worker_env(), cwd=ROOT)
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
        time.sleep(0.1)
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err
    assert "Traceback" not in err
    assert "disttrain run: stopped by SIGTERM" in err
    assert all((tmp_path / f"saved{r}").exists() for r in range(2))


ELASTIC = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
TRAIN = ["-m", "disttrain.train", "examples/tiny_gpt.toml"]


def test_warm_workers_for_every_python_worker_but_fast_recovery(monkeypatch):
    monkeypatch.delenv("DISTTRAIN_WARM_WORKERS", raising=False)
    args = launch.torchrun_for(ELASTIC + TRAIN).args
    assert args[-3:] == ["disttrain.launch.warm_workers", "disttrain.train", "examples/tiny_gpt.toml"]
    args = launch.torchrun_for(["--nproc", "2"] + TRAIN).args
    assert args[-3:] == ["disttrain.launch.warm_workers", "disttrain.train", "examples/tiny_gpt.toml"]
    # a user's script: the forked child runs it through worker_entry (its watchdog there)
    args = launch.torchrun_for(ELASTIC + [SCRIPT, "x"]).args
    assert args[-6:] == ["disttrain.launch.worker_entry", "-m", "disttrain.launch.warm_workers",
                         "disttrain.launch.worker_entry", SCRIPT, "x"]
    assert "-m" in args[:-6]
    monkeypatch.setenv("DISTTRAIN_JOB_SECRET", "ab" * 32)  # a multi-node fast-recovery job needs the user's
    for argv in (ELASTIC + TRAIN + ["--elastic.fast_recovery=true"], ["--fast-recovery", SCRIPT],
                 ["--no-python", "echo"]):
        assert "disttrain.launch.warm_workers" not in launch.torchrun_for(argv).args
    monkeypatch.setenv("DISTTRAIN_WARM_WORKERS", "0")
    assert "disttrain.launch.warm_workers" not in launch.torchrun_for(ELASTIC + TRAIN).args


def test_a_bad_warm_workers_switch_is_one_clear_message():
    proc = run_disttrain(["run", *ELASTIC, *TRAIN], timeout=60,
                         env=worker_env(DISTTRAIN_WARM_WORKERS="yes"))
    assert proc.returncode == 2
    assert "DISTTRAIN_WARM_WORKERS is 'yes'; set it to 1" in proc.stderr and "Traceback" not in proc.stderr


PROBE = '''import os, signal, sys, time
print("warm" if "torch" in sys.modules else "cold", os.environ.get("PROBE_TAG"), os.getcwd(), flush=True)
if sys.argv[1] == "wait":  # before the pid is written: the test signals once it reads the pid
    signal.signal(signal.SIGTERM, lambda *_: (print("saved on SIGTERM", flush=True), sys.exit(0)))
(open(sys.argv[2], "w").write(str(os.getpid())) if len(sys.argv) > 2 else None)
if sys.argv[1] == "exit3":
    sys.exit(3)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "wait":
    time.sleep(120)
'''


def _stub(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    stub = [sys.executable, "-u", "-m", "disttrain.launch.warm_workers", "warm_probe", *args]
    return subprocess.Popen(stub,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(PYTHONPATH=f"{ROOT / 'src'}:{tmp_path}", PROBE_TAG="tag", **env))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _wait_for_pid(pid_file, proc: subprocess.Popen, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)


def test_warm_worker_stub_acts_as_the_worker_process(tmp_path, monkeypatch):
    """The stub torchrun watches: the child runs with torch already imported, the stub's
    environment and directory; exit status and death by signal pass through; SIGTERM
    reaches the child; a killed stub takes its child with it; no server: runs itself."""
    import signal
    import time

    from disttrain.launch import warm_workers

    (tmp_path / "warm_probe.py").write_text(PROBE)
    proc = _stub(tmp_path, "exit3")  # no server: the module runs in the stub itself
    assert proc.wait(timeout=60) == 3 and proc.stdout.read().startswith("cold tag")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'src'}:{tmp_path}")
    server = warm_workers.start_server()
    path = server[1]
    try:
        proc = _stub(tmp_path, "exit3", DISTTRAIN_WARM_SOCKET=path)
        assert proc.wait(timeout=120) == 3
        assert proc.stdout.read().split()[:3] == ["warm", "tag", str(tmp_path)]
        proc = _stub(tmp_path, "kill", DISTTRAIN_WARM_SOCKET=path)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        pid_file = tmp_path / "pid"
        proc = _stub(tmp_path, "wait", str(pid_file), DISTTRAIN_WARM_SOCKET=path)
        _wait_for_pid(pid_file, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0 and "saved on SIGTERM" in proc.stdout.read()
        pid_file.unlink()
        proc = _stub(tmp_path, "wait", str(pid_file), DISTTRAIN_WARM_SOCKET=path)
        _wait_for_pid(pid_file, proc)
        child = int(pid_file.read_text())
        proc.kill()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _running(child):
            assert time.monotonic() < deadline, "the killed stub's child still runs"
            time.sleep(0.05)
    finally:
        warm_workers.stop_server(server)


def test_a_stub_and_its_worker_dying_together_leave_the_server_serving(tmp_path, monkeypatch):
    """The server sees a worker's end and its stub's closed connection in one wakeup (held
    stopped while both die, as when a node's processes are killed at once): it goes on
    serving, and the next stub's worker is forked warm."""
    import signal
    import time

    from disttrain.launch import warm_workers

    (tmp_path / "warm_probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'src'}:{tmp_path}")
    server = warm_workers.start_server()
    try:
        pid_file = tmp_path / "pid"
        proc = _stub(tmp_path, "wait", str(pid_file), DISTTRAIN_WARM_SOCKET=server[1])
        _wait_for_pid(pid_file, proc)
        child = int(pid_file.read_text())
        os.kill(server[0], signal.SIGSTOP)
        try:
            os.kill(child, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _running(child):  # the worker's end first, then the stub's
                assert time.monotonic() < deadline
                time.sleep(0.01)
            proc.kill()
            proc.wait(timeout=30)
        finally:
            os.kill(server[0], signal.SIGCONT)
        proc = _stub(tmp_path, "exit3", DISTTRAIN_WARM_SOCKET=server[1])
        assert proc.wait(timeout=120) == 3
        assert proc.stdout.read().split()[:1] == ["warm"]  # "cold": the server had died
        assert _running(server[0])
    finally:
        warm_workers.stop_server(server)


def test_a_finished_scripts_globals_live_until_exit(tmp_path, monkeypatch):
    """As under `python SCRIPT`, a script's globals outlive its last line: freed by
    worker_entry while the process still ran, a DDP model left in a global destroyed its
    gloo group with the GIL held and the rank could hang after its script was done."""
    from disttrain.launch import worker_entry

    script = tmp_path / "script.py"
    script.write_text("import pathlib, sys\nclass Flag:\n    def __del__(self):\n"
                      "        pathlib.Path(sys.argv[1]).write_text('freed')\nflag = Flag()\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    worker_entry.main([str(script), str(tmp_path / "freed")])
    import gc

    gc.collect()
    assert not (tmp_path / "freed").exists()


@pytest.mark.parametrize("poisoned", [True, False])
def test_warm_server_not_used_when_cuda_poisoned_its_fork_mocked_cuda(monkeypatch, poisoned):
    """On an H200, `disttrain run` of a user script (and of a config whose imports
    counted the devices) failed in every worker with "Cannot re-initialize CUDA in forked
    subprocess": the agent had counted GPUs through the driver before forking the warm
    server. Mocked: no GPU here, so the fork's poisoned state is patched in; the server
    must then say so and leave the workers to fresh interpreters."""
    from disttrain.launch import warm_workers
    from disttrain.runtime import torch_compat

    monkeypatch.setattr(torch_compat, "cuda_fork_poisoned", lambda: poisoned)
    server = warm_workers.start_server()
    try:
        if poisoned:
            assert server is None
        else:
            assert server is not None and os.path.exists(server[1])
            os.kill(server[0], 0)  # alive and serving
    finally:
        if server is not None:
            warm_workers.stop_server(server)


def test_a_stop_in_the_middle_of_failed_attempts_with_nothing_saved_exits_non_zero(tmp_path):
    """SIGTERM to the launcher: a clean stop (0, a scheduler's requeue) when a rank saved
    after it or the job had not failed; after failed attempts (a crash loop, spare
    take-overs) with nothing saved, 143 and a line that says so (before: 0 and "a script
    without dt.Job saves nothing")."""
    import signal

    from disttrain import worker_notes

    assert worker_notes.failed_attempts(tmp_path) == 0
    for name in ("failure-000000-000001", "said-failure-000000-000001", "said-failure-000001-000000",
                 "said-promotion-rank1-000001", "saved-rank0", "said-other"):
        (tmp_path / name).write_text("")
    assert worker_notes.failed_attempts(tmp_path) == 3  # two attempts' failures, one take-over
    line, status = end_lines.stopped_by_signal(signal.SIGTERM, None, 3)
    assert status == 143 and "failed 3 time(s) before the signal" in line
    line, status = end_lines.stopped_by_signal(signal.SIGTERM, 12, 3)
    assert status == 0 and "saved step 12" in line
    assert end_lines.stopped_by_signal(signal.SIGTERM, None, 0)[1] == 0
    assert end_lines.stopped_by_signal(signal.SIGINT, None, 0)[1] == 130
