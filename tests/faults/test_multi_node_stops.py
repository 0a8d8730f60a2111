"""The program's failure on one node of a fast-recovery job stops every node
(`elastic.job_stop`). Before, the failing node's launcher alone said the "not
retried" line; the other nodes saw only a node whose supervisors stopped beating,
shrank in memory without it and finished with exit 0. Two agents of one rank each
("two nodes" on loopback) under the etcd rendezvous, real processes: every node must
end with the same last line and status, none shrinks, none restarts."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, WORKERS, worker_env
from elastic_helpers import kill_node, metrics, start, trainer_cmd, wait_for

from disttrain.launch.etcd_server import EtcdServer, free_port

SCRIPT = str(WORKERS / "failing_job.py")
ENDS = {
    # kind: (exit status, the last line's start after "disttrain run: not retried: ")
    "return": (1, "rank 1 finished its code (a return, a break or an exit 0 on one rank only) while rank 0 still "
                  "waited in a collective at step 6"),
    "segv": (139, "rank 1 died of SIGSEGV, a crash in native code"),
}


def two_nodes(tmp_path: Path, run_id: str, command: list[str], *extra: str, backend: str = "etcd",
              secret: bool = True, **env: str) -> list[tuple[int, str]]:
    """Start `disttrain run --nnodes 2 --nproc 1 [EXTRA] ... COMMAND` twice on one etcd (or
    a c10d rendezvous), with the job's secret exported unless `secret` is False, and wait
    for both; their exit statuses and outputs."""
    if secret:
        env["DISTTRAIN_JOB_SECRET"] = "5e" * 32
    with EtcdServer().start() if backend == "etcd" else contextlib.nullcontext() as server:
        endpoint = server.endpoint if server else f"127.0.0.1:{free_port()}"
        flags = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                 "--rdzv-id", run_id, *extra]
        full = [sys.executable, "-m", "disttrain.cli", "run", *flags, *command]
        logs = [tmp_path / f"node{i}.txt" for i in range(2)]
        nodes = [subprocess.Popen(full, cwd=ROOT, env=worker_env(**env),
                                  stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
                 for log in logs]
        try:
            codes = [node.wait(timeout=150) for node in nodes]
        finally:
            for node in nodes:
                kill_node(node)
    return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]


def assert_both_stopped(ends: list[tuple[int, str]], status: int, line: str) -> None:
    for code, text in ends:
        last = text.rstrip().splitlines()[-1]
        assert code == status and last.startswith(f"disttrain run: not retried: {line}"), text[-4000:]
        assert "lost with their supervisors" not in text and "finished at world" not in text, text[-4000:]
        assert "took over" not in text and "will restart worker group" not in text, text[-4000:]


@pytest.mark.parametrize("kind", sorted(ENDS))
def test_a_scripts_failure_on_one_node_stops_every_node(kind, tmp_path):
    """A `dt.Job` script (`disttrain run --fast-recovery SCRIPT`) whose rank 1 returns from
    its loop (its node's launcher alone knew: the rank ended with status 0), or segfaults
    (the note is its stub's) at step 6. An exception is the trainer's test below."""
    status, line = ENDS[kind]
    out = tmp_path / "out"
    ends = two_nodes(tmp_path, f"stop-{kind}", ["--fast-recovery", SCRIPT, str(out), "--raise-at", "6",
                                                "--kind", kind, "--steps", "40"])
    assert_both_stopped(ends, status, line)
    assert len((out / "starts.log").read_text().splitlines()) == 1  # no new generation, no restart


def test_the_trainers_failure_on_one_node_stops_every_node(tmp_path):
    """`disttrain run -m disttrain.train` with fast recovery in its config: rank 1 raises in
    its forward of step 6 (an injected fault)."""
    command = trainer_cmd(tmp_path, "--train.steps=24", "--elastic.fast_recovery=true", "--checkpoint.every=3",
                          run_flags=())[4:]
    ends = two_nodes(tmp_path, "stop-trainer", command, DISTTRAIN_FAULT="raise@forward:rank=1,step=6")
    assert_both_stopped(ends, 1, "RuntimeError at step 6 on rank 1 is the program's error")
    assert max(m["step"] for m in metrics(tmp_path)) == 5


@pytest.mark.parametrize(("backend", "failing", "restarts", "secret"),
                         [("etcd", 1, "3", True), ("c10d", 0, "0", True), ("etcd", 1, "3", False)])
def test_without_fast_recovery_the_other_node_ends_at_once_and_says_why(backend, failing, restarts, secret,
                                                                        tmp_path):
    """torchrun's restart path (no fast recovery): one rank raises at step 6. Its node
    stops on the note, relays it on the rendezvous' store (sealed with the job's secret)
    and closes the rendezvous, so the other node, whose rank lost its peer, ends at once:
    with the secret, with the same traceback, line and status; without it, with a line
    that sends the user to the failing node. Before, that node restarted its rank into a
    rendezvous nobody else joined and ended after the join timeout (2 min) in torch's
    traceback; with no restart left it blamed its own rank. Under c10d the failing rank
    is on the node that hosts the rendezvous (and its store)."""
    command = trainer_cmd(tmp_path, "--train.steps=24", "--checkpoint.every=3", run_flags=())[4:]
    ends = two_nodes(tmp_path, f"restart-path-{backend}", command, "--max-restarts", restarts, backend=backend,
                     secret=secret, DISTTRAIN_FAULT=f"raise@forward:rank={failing},step=6")
    (code, failed), (other_code, other) = ends[failing], ends[1 - failing]
    line = f"disttrain run: not retried: RuntimeError at step 6 on rank {failing} is the program's error"
    assert code == 1 and failed.rstrip().splitlines()[-1].startswith(line), failed
    last = other.rstrip().splitlines()[-1]
    closed = f"disttrain run: another node stopped the job and closed its rendezvous (rank(s) [{1 - failing}] of"
    # under c10d the rendezvous and its store end with their host's launcher: the note
    # may be gone before this node asks, or the rendezvous itself
    gone = "disttrain run: the rendezvous at 127.0.0.1:"
    expected = (line,) if secret else (closed,)
    assert other_code == 1 and last.startswith(expected + ((closed, gone) if backend == "c10d" else ())), other
    assert "will restart worker group" not in other and "rendezvous.api." not in other, other[-4000:]
    if secret and backend == "etcd":
        assert "injected fault at forward, step 6, rank 1" in other  # the failing rank's traceback
        assert "lost a peer" not in other, other  # its rank read the note first: no line of its own


def test_a_plain_scripts_error_on_one_node_is_every_nodes_last_lines(tmp_path):
    """The same through a plain script (no dt.Job) on torchrun's restart path, with the
    job's secret: rank 1 raises; both nodes end with its traceback and line, status 1."""
    ends = two_nodes(tmp_path, "plain-restart-path", [str(WORKERS / "hello.py"), str(tmp_path / "ranks.txt"),
                                                      "--raise-rank", "1"], "--max-restarts", "2")
    for code, text in ends:
        last = text.rstrip().splitlines()[-1]
        assert code == 1 and last.startswith("disttrain run: not retried: RuntimeError on rank 1 is the"), text
        assert "shapes do not match" in text and "lost a peer" not in text, text[-3000:]


def test_a_lost_node_without_fast_recovery_ends_the_other_in_one_line(tmp_path):
    """A whole node killed (its launcher and ranks, no note) under a fixed --nnodes 2 with
    restarts left: the survivor's restart waits for a rendezvous that cannot fill, and
    says so in one line after its join timeout (here 10 s), not in a traceback; it does
    not claim that another node stopped the job."""
    with EtcdServer().start() as server:
        flags = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                 "--rdzv-id", "lost-node", "--max-restarts", "3", "--rdzv-conf", "join_timeout=10"]
        command = trainer_cmd(tmp_path, "--train.steps=200", run_flags=tuple(flags))
        logs = [tmp_path / f"node{i}.txt" for i in range(2)]
        nodes = [start(command, log, DISTTRAIN_FAULT="delay@step:ms=200") for log in logs]
        try:
            wait_for(lambda: any(m["step"] > 3 for m in metrics(tmp_path)), 120, "training", logs)
            kill_node(nodes[1])
            code = nodes[0].wait(timeout=120)
        finally:
            for node in nodes:
                kill_node(node)
    text = logs[0].read_text()
    last = text.rstrip().splitlines()[-1]
    assert code == 1 and last.startswith("disttrain run: the rendezvous did not fill within its join timeout"), text
    assert "Traceback" not in text and "another node stopped the job" not in text, text[-4000:]


def test_a_second_job_with_the_same_rdzv_id_is_told_to_take_its_own(tmp_path):
    """torch closes a job's rendezvous when the job ends, and etcd keeps it closed: the
    same command run again on the same etcd (the same --rdzv-id) is refused at its first
    rendezvous, in one line that says to give the job its own id, not in torch's
    traceback. Another id runs."""
    script = [str(WORKERS / "hello.py"), str(tmp_path / "ranks.txt")]
    with EtcdServer().start() as server:
        def job(run_id: str) -> subprocess.CompletedProcess:
            flags = ["--nnodes", "1:2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                     server.endpoint, "--rdzv-id", run_id]
            return subprocess.run([sys.executable, "-m", "disttrain.cli", "run", *flags, *script], cwd=ROOT,
                                  env=worker_env(), capture_output=True, text=True, timeout=150)

        first, again, other = job("same"), job("same"), job("other")
    assert first.returncode == 0 and other.returncode == 0, first.stderr[-3000:] + other.stderr[-3000:]
    last = again.stderr.rstrip().splitlines()[-1]
    assert again.returncode == 1 and last.startswith("disttrain run: the rendezvous of --rdzv-id same at "), last
    assert "Give each job its own --rdzv-id" in last and "Traceback" not in again.stderr, again.stderr[-3000:]


def test_a_return_on_one_rank_without_fast_recovery_stops_both_nodes(tmp_path):
    """A `dt.Job` script whose rank 1 returns from its loop at step 6, on torchrun's restart
    path, with the job's secret. Its finish is relayed on the rendezvous' store; rank 0,
    whose collective failed, reads it and says the early finish, and both nodes stop with
    that line. Before, rank 0 took it for a lost peer and its node ended after the join
    timeout (2 min), while node 1 waited at torchrun's exit barrier (5 min) to exit 0."""
    status, line = ENDS["return"]
    out = tmp_path / "out"
    ends = two_nodes(tmp_path, "return-restart-path", [SCRIPT, str(out), "--raise-at", "6", "--kind", "return",
                                                       "--steps", "40"], "--max-restarts", "2")
    for code, text in ends:
        last = text.rstrip().splitlines()[-1]
        assert code == status and last.startswith(f"disttrain run: not retried: {line}"), text[-3000:]
        assert "lost a peer" not in text and "join timeout" not in text, text[-3000:]
