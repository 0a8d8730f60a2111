"""Whose failure: the machine's is retried, the program's is not (runtime/failures.py,
docs/elastic.md "What is retried and what is not"). Real `disttrain run` jobs of
tests/workers/failing_job.py on gloo, under both recovery paths: in-memory
(`--fast-recovery`) and torchrun's restart (`--max-restarts 3`). Every launch has a
timeout: a job that retries forever fails the test."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from conftest import WORKERS, run_disttrain, worker_env

SCRIPT = str(WORKERS / "failing_job.py")
PATHS = {"fast": ("--fast-recovery", "--nproc", "2"), "restart": ("--nproc", "2", "--max-restarts", "3")}


def launch(out: Path, path: str, *args: str, fault: str | None = None, timeout: float = 150):
    env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
    proc = run_disttrain(["run", *PATHS[path], SCRIPT, str(out), *args], timeout=timeout, env=env)
    return proc, proc.stdout + proc.stderr


def starts(out: Path) -> int:
    """How often the job started on rank 0: attempts plus in-memory generations."""
    return len((out / "starts.log").read_text().splitlines())


@pytest.mark.parametrize("path, rank", [("fast", 1), ("restart", 1), ("fast", 0)])
def test_the_programs_error_is_reported_once_and_last_and_not_retried(path, rank, tmp_path):
    """A rank raises RuntimeError at step 6 in every attempt (rank 0: its slot hosts the
    fast recovery's store). Before: under fast recovery a new generation redid step 6
    forever and the error was never printed; under --max-restarts 3 four attempts, and
    a survivor's gloo traceback last."""
    proc, out = launch(tmp_path, path, "--raise-at", "6", "--raise-rank", str(rank), "--steps", "20")
    assert proc.returncode == 1, out[-3000:]
    assert starts(tmp_path) == 1, out[-3000:]  # no generation, no restart after the failure
    lines = proc.stderr.rstrip().splitlines()
    assert lines[-1] == (f"disttrain run: not retried: RuntimeError at step 6 on rank {rank} is the program's "
                         "error (exit status 1)."), out[-3000:]
    assert lines[-2] == "RuntimeError: shapes do not match"
    assert out.count("Traceback") == 1 and out.count("RuntimeError: shapes do not match") == 1, out[-3000:]
    assert "gloo" not in out and "Connection closed" not in out and "took over" not in out


def test_a_plain_scripts_error_is_not_retried_either(tmp_path):
    """A script without dt.Job (tests/workers/hello.py) whose rank 1 raises: one attempt
    under --max-restarts 3, its traceback last, then the line (no step: the script's
    steps are unknown). Before: four attempts, a survivor's gloo traceback among them."""
    marks = tmp_path / "starts.txt"
    proc = run_disttrain(["run", "--nproc", "2", "--max-restarts", "3", str(WORKERS / "hello.py"), str(marks),
                          "--raise-rank", "1"], timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and len(marks.read_text().splitlines()) == 2, out[-3000:]
    lines = proc.stderr.rstrip().splitlines()
    assert lines[-2:] == ["RuntimeError: shapes do not match", "disttrain run: not retried: RuntimeError on "
                          "rank 1 is the program's error (exit status 1)."], out[-3000:]
    assert out.count("Traceback") == 1 and "gloo" not in out


@pytest.mark.parametrize("path, kind, error", [("restart", "oom", "OutOfMemoryError"),
                                               ("fast", "hostoom", "MemoryError")])
def test_out_of_memory_is_one_line_with_the_estimate_and_the_fixes(path, kind, error, tmp_path):
    """The model (8 -> 16 -> 1, 161 parameters, AdamW, fp32, ddp on 2 ranks): 16 bytes
    of state per parameter plus 4 per tensor's step, 2.53 KiB per rank; sharded by FSDP
    about half. The CUDA error is raised as torch raises it (no GPU here)."""
    proc, out = launch(tmp_path, path, "--raise-at", "3", "--kind", kind)
    assert proc.returncode == 1 and starts(tmp_path) == 1, out[-3000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"disttrain run: not retried: {error} at step 3 on rank 1 is the program's error; "
                           f"the planner puts the model's weights, gradients and adamw state at 2.53 KiB "
                           f"per rank under ddp on 2 rank(s) (1.41 KiB under fsdp)"), last
    for fix in ("a smaller batch per rank", "activation checkpointing", "strategy='fsdp'"):
        assert fix in last
    assert out.count("Traceback") == 1


@pytest.mark.parametrize("path, at", [("fast", "6"), ("restart", "6"), ("restart", "-1")])
def test_the_same_unclassified_failure_twice_in_a_row_stops_the_job(path, at, tmp_path):
    """A TimeoutError (a collective's or the user's: it cannot be told) at step 6, or
    before the first step, in every attempt is retried once, then the job stops, saying
    so. Before: retried forever under fast recovery, three restarts under --max-restarts 3."""
    proc, out = launch(tmp_path, path, "--raise-at", at, "--kind", "timeout")
    assert proc.returncode == 1, out[-3000:]
    assert starts(tmp_path) == 2, out[-3000:]
    where = "at step 6" if at == "6" else "before the first step"
    assert ("stopped: two " + ("generations" if path == "fast" else "attempts") + " in a row ended with the same "
            f"failure (TimeoutError: timed out waiting for the data service {where})") in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.parametrize("fault", ["kill@backward:rank=1,step=6", "exit@backward:rank=1,step=6,code=3"])
def test_a_lost_peer_on_the_restart_path_is_one_line_without_a_traceback(fault, tmp_path):
    """kill -9 of a worker, and a worker that exits (its peer sees the connection
    closed): restarted as before, and the survivor says one line, its trace in its log.
    Before: the survivor's gloo traceback on the console."""
    proc, out = launch(tmp_path, "restart", "--steps", "10", fault=fault)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "pair.cc" not in out, out[-3000:]
    lost = [line for line in out.splitlines() if "lost a peer" in line]
    assert len(lost) == 1 and lost[0].startswith("disttrain run: rank 0 lost a peer at step 6 ("), lost
    assert "torchrun restarts the job from its newest checkpoint (3 restart(s) left)" in lost[0]
    trace = Path(lost[0].rsplit("full trace in ", 1)[1])
    assert "Connection closed by peer" in trace.read_text() or "Connection reset" in trace.read_text()
    assert "resumed at step 4" in out and starts(tmp_path) == 2


class LineServer:
    """A loopback TCP server that keeps what each connection sent."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[list[str]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            lines: list[str] = []
            self.received.append(lines)
            threading.Thread(target=self._read, args=(conn, lines), daemon=True).start()

    @staticmethod
    def _read(conn, lines):
        buf = b""
        with conn:
            while chunk := conn.recv(4096):
                buf += chunk
                *done, buf = buf.split(b"\n")
                lines.extend(d.decode() for d in done)


def test_a_users_connection_survives_an_in_memory_recovery(tmp_path):
    """Rank 0's tracker connection (opened before the job, kept across generations) is
    used after rank 1's kill -9 is recovered in memory. Before: the survivors cut every
    connection opened since the generation began, the user's too."""
    server = LineServer()
    try:
        proc, out = launch(tmp_path, "fast", "--steps", "10", "--tcp", str(server.port),
                           fault="kill@backward:rank=1,step=6")
    finally:
        server.sock.close()
    assert proc.returncode == 0, out[-3000:]
    assert "warm spare took over" in out and starts(tmp_path) == 2
    assert len(server.received) == 1, server.received
    sent = server.received[0]
    again = sent.index("start", 1)  # the script's second run, in the next generation
    assert sent[-1] == "done" and sent[again + 1:-1] == [f"step {s}" for s in range(5, 10)], sent


def test_classifier_contract():
    """The table of runtime/failures.py, case by case (the words are gloo's and NCCL's)."""
    from disttrain.runtime import failures

    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5285")
    slow = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv")
    cases = [(closed, False, failures.MACHINE), (slow, False, failures.UNKNOWN), (slow, True, failures.MACHINE),
             (RuntimeError("NCCL error: remote process exited (ncclRemoteError)"), False, failures.MACHINE),
             (RuntimeError("shapes do not match"), False, failures.PROGRAM),
             (RuntimeError("shapes do not match"), True, failures.PROGRAM),
             (ConnectionResetError(104, "Connection reset by peer"), False, failures.PROGRAM),
             (MemoryError(), False, failures.PROGRAM), (KeyError("x"), True, failures.PROGRAM)]
    for exc, gone, kind in cases:
        assert failures.classify(exc, peer_gone=gone).kind == kind, exc
    assert failures.classify(MemoryError()).oom
    assert failures.classify_death(-9).kind == failures.MACHINE
    for sig in (-11, -6, -7, -4, -8, -2):  # SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE: raised by itself; SIGINT
        assert failures.classify_death(sig).kind == failures.PROGRAM, sig
    assert failures.classify_death(-15).kind == failures.MACHINE  # a stop
    assert failures.classify_death(-10).kind == failures.UNKNOWN  # SIGUSR1's default: nobody's
    assert failures.classify_death(3).kind == failures.UNKNOWN  # an exit status without a note
    a = failures.signature("RuntimeError", str(slow) + " [10.0.0.1]:4000", 6)
    assert a == failures.signature("RuntimeError", str(slow).replace("3000ms", "2999ms") + " [10.0.0.2]:51", 6)
    assert a != failures.signature("RuntimeError", str(slow), 7)
    assert failures.signature("E", "m", 0).endswith("before the first step")


def test_cut_shuts_the_groups_connections_and_no_other():
    """elastic/group_sockets.py in one process: a connection to a "group" listener and
    one accepted by it are shut; a connection to another server stays usable."""
    from disttrain.elastic import group_sockets

    group, other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    with group, other:
        out_to_group = socket.create_connection(group.getsockname())
        accepted, _ = group.accept()
        user = socket.create_connection(other.getsockname())
        served, _ = other.accept()
        assert group_sockets.listeners() >= {group.getsockname(), other.getsockname()}
        assert group_sockets.cut({group.getsockname()}) == 2  # both ends of the group's pair
        assert out_to_group.recv(1) == b"" and accepted.recv(1) == b""
        user.sendall(b"still open")
        assert served.recv(10) == b"still open"
        for s in (out_to_group, accepted, user, served):
            s.close()
