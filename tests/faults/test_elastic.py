"""Elastic and fault tolerance with real torchrun agents, real signals and a real etcd
(P-ELASTIC-1..6, P-DATA-3,4). Every wait has a timeout: a hang fails the test."""

from __future__ import annotations

import functools
import os
import random
import signal
import sys
import time
from collections import Counter

import pytest
import torch
from conftest import built_once
from elastic_helpers import (
    TINY,
    audit_timeline,
    descendants,
    kill_node,
    last_loss_per_step,
    load_params,
    metrics,
    start,
    trainer_cmd,
    wait_for,
)

from disttrain.launch.etcd_server import EtcdServer, free_port

PHASES = ["forward", "backward", "step", "checkpoint.shards", "checkpoint.after_shards"]
STEPS = 24
SLOW = "delay@step:ms=300"  # long enough for the scale events to land mid-epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of the tiny job, per strategy, for bit-exact comparisons."""

    def run(strategy: str, out):
        log = out / "log.txt"
        proc = start(trainer_cmd(out, f"--train.steps={STEPS}", "--checkpoint.every=1",
                                 f"--parallel.strategy={strategy}"), log)
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        return out

    return lambda strategy: built_once(tmp_path_factory, f"elastic-ref-{strategy}",
                                       functools.partial(run, strategy))


def assert_same_run(ref, out):
    a, b = load_params(ref / "model.pt"), load_params(out / "model.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"
    assert last_loss_per_step(out) == last_loss_per_step(ref)  # same per-step losses, bit for bit


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_kill_9_at_five_points_recovers_bit_exactly(strategy, reference, tmp_path):
    """P-ELASTIC-6: kill -9 one worker at five (step, phase) points, one per restart."""
    seed = int(os.environ.get("DISTTRAIN_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 1), 5))
    points = [(s, rng.choice(PHASES), rng.randrange(2)) for s in steps]
    print(f"fault seed {seed}: {points}")
    spec = ";".join(f"kill@{phase}:rank={rank},step={s},restart={k}"
                    for k, (s, phase, rank) in enumerate(points))
    log = tmp_path / "log.txt"
    proc = start(trainer_cmd(tmp_path, f"--train.steps={STEPS}", "--checkpoint.every=1",
                             f"--parallel.strategy={strategy}",
                             run_flags=("--nproc", "2", "--max-restarts", "6")), log,
                 DISTTRAIN_FAULT=spec)
    assert proc.wait(timeout=300) == 0, f"seed {seed}\n" + log.read_text()[-4000:]
    assert log.read_text().count("disttrain fault: kill") == 5, f"seed {seed}"
    assert_same_run(reference(strategy), tmp_path)


def test_sigterm_saves_exits_zero_and_resumes_bit_exactly(reference, tmp_path):
    """Preemption: SIGTERM mid-step to every process of the job but the launcher (as a
    scheduler signals a job step: the workers torchrun watches, the processes that
    train, the warm server); all exit 0 within the grace period; the same
    command resumes and ends as the uninterrupted run."""
    log = tmp_path / "log.txt"
    cmd = trainer_cmd(tmp_path, f"--train.steps={STEPS}", "--checkpoint.every=1000",
                      "--elastic.preempt_grace_s=20")
    agent = start(cmd, log, DISTTRAIN_FAULT="delay@backward:ms=150")
    wait_for(lambda: any(m["step"] >= 6 for m in metrics(tmp_path)), 120, "step 6", [log])
    pids = descendants(agent.pid)
    assert len(pids) == 5  # the 2 stubs torchrun watches, their 2 forked trainers, the warm server
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    # Exit 0 means every rank saved and stopped by itself: past the 20 s grace, torchrun's
    # shutdown would have killed them and the agent would report their signal.
    assert agent.wait(timeout=60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "preempted (SIGTERM)" in text
    stopped_at = max(m["step"] for m in metrics(tmp_path))
    assert stopped_at < STEPS
    again = start(cmd, log)
    assert again.wait(timeout=180) == 0, log.read_text()[-3000:]
    assert f"resumed at step {stopped_at}" in log.read_text()
    assert_same_run(reference("ddp"), tmp_path)


def _listener(port: int, agents: list) -> int:
    """Which of `agents` (processes) listens on TCP `port` (read from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rpartition(":")[2], 16) == port and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    for i, agent in enumerate(agents):
        fds = f"/proc/{agent.pid}/fd"
        if any(os.readlink(f"{fds}/{fd}") in {f"socket:[{n}]" for n in inodes} for fd in os.listdir(fds)):
            return i
    raise AssertionError(f"no agent listens on port {port}")


@pytest.mark.parametrize("backend", ["c10d"])
def test_scale_down_and_up_exactly_once(backend, tmp_path):
    """Two agents (--nnodes 1:2). One is killed: the survivor continues at world 1.
    A new agent joins: back to world 2. Every index of the epoch is consumed exactly
    once on the final timeline, and the loss continues from the breakpoint.
    c10d: the agent that does not host the store dies. (etcd, with etcd itself restarted
    mid-run, is tests/faults/test_netns.py's: two nodes in their own network namespaces.)"""
    server = EtcdServer().start() if backend == "etcd" else None
    try:
        endpoint = server.endpoint if server else f"127.0.0.1:{free_port()}"
        flags = ("--nnodes", "1:2", "--nproc", "1", "--rdzv-backend", backend, "--rdzv-endpoint",
                 endpoint, "--rdzv-id", f"job-{backend}", "--max-restarts", "10")
        cmd = trainer_cmd(tmp_path, "--train.steps=48", "--data.max_bytes=12289",
                          "--checkpoint.every=2", run_flags=flags)
        logs = [tmp_path / f"agent{i}.txt" for i in range(3)]
        agents = [start(cmd, logs[0], DISTTRAIN_FAULT=SLOW)]
        time.sleep(1.0)  # the first agent hosts the c10d store
        agents.append(start(cmd, logs[1], DISTTRAIN_FAULT=SLOW))

        def progressed(world: int, beyond: int) -> bool:
            return any(m["world_size"] == world and m["step"] > beyond for m in metrics(tmp_path))

        wait_for(lambda: progressed(2, 4), 150, "world 2 training", logs)
        if server:  # etcd restarts under a running job: training goes on
            server.restart()
            mark = max(m["step"] for m in metrics(tmp_path))
            wait_for(lambda: progressed(2, mark + 2), 60, "progress after the etcd restart", logs)
        mark = max(m["step"] for m in metrics(tmp_path))
        # c10d: the agent that does not host the store (the first one, unless a slow start
        # let the second bind the endpoint first)
        victim = 0 if backend == "etcd" else 1 - _listener(int(endpoint.rpartition(":")[2]), agents)
        kill_node(agents[victim])
        wait_for(lambda: progressed(1, mark + 2), 90, "world 1 after scale-down", logs)
        mark = max(m["step"] for m in metrics(tmp_path) if m["world_size"] == 1)
        agents.append(start(cmd, logs[2], DISTTRAIN_FAULT=SLOW))
        wait_for(lambda: progressed(2, mark), 90, "world 2 after scale-up", logs)
        survivors = [a for i, a in enumerate(agents) if i != victim]
        for a in survivors:
            assert a.wait(timeout=150) == 0, "\n".join(p.read_text()[-3000:] for p in logs)
    finally:
        for a in locals().get("agents", []):
            kill_node(a)
        if server:
            server.stop()
    timeline = audit_timeline(tmp_path)
    assert sorted(timeline) == list(range(1, 49))  # one epoch: 384 chunks, 8 per step
    counts = Counter(i for step in timeline.values() for i in step)
    assert sorted(counts) == list(range(384)) and set(counts.values()) == {1}
    # The loss continues from the breakpoint: no restart to step 0, no spike.
    records = metrics(tmp_path)
    worlds = [m["world_size"] for m in records]
    assert 1 in worlds and worlds[-1] == 2
    for i in range(1, len(records)):
        if records[i]["world_size"] != records[i - 1]["world_size"]:
            assert records[i]["step"] > 2  # resumed near the breakpoint, not at step 0
            before = [m["loss"] for m in records[max(0, i - 6):i]]
            assert records[i]["loss"] < max(before) * 1.25


def test_stopped_worker_is_restarted_within_the_bound(reference, tmp_path):
    """Stall: SIGSTOP rank 1 mid-step. The watchdog names it within its bound, the job
    restarts (not torch's 30-minute timeout), resumes, and ends as the uninterrupted run."""
    log = tmp_path / "log.txt"
    proc = start(trainer_cmd(tmp_path, f"--train.steps={STEPS}", "--checkpoint.every=1",
                             "--guard.hang_min_s=4", "--guard.hang_cap_s=8",
                             run_flags=("--nproc", "2", "--max-restarts", "2")), log,
                 DISTTRAIN_FAULT="stop@forward:rank=1,step=6")
    assert proc.wait(timeout=150) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "disttrain fault: stop at forward, step 6, rank 1" in text
    assert "rank 1" in text and "stopped" in text  # the watchdog's verdict names the rank
    assert_same_run(reference("ddp"), tmp_path)


def test_loader_knobs_change_across_whole_job_kills_and_every_sample_is_used_once(tmp_path):
    """`disttrain train`, killed whole (kill -9 of every process) twice: world 2 -> 1 -> 2
    and data.num_workers 0 -> 3 -> 2 (pin_memory and persistent_workers with them). The
    loader knobs are not the run's identity: each attempt resumes from the newest
    checkpoint with the knobs as set, and the sample audit shows every index of the
    epoch exactly once on the final timeline."""
    base = [sys.executable, "-m", "disttrain.cli", "train", "examples/tiny_gpt.toml", *TINY,
            f"--train.out_dir={tmp_path}", "--train.steps=48", "--data.max_bytes=12289",
            "--checkpoint.every=2"]
    attempts = [("2", "0", "false"), ("1", "3", "true"), ("2", "2", "false")]
    logs = [tmp_path / f"attempt{i}.txt" for i in range(3)]
    for i, (nproc, workers, keep) in enumerate(attempts):
        cmd = [*base, f"--parallel.nproc={nproc}", f"--data.num_workers={workers}",
               f"--data.persistent_workers={keep}", f"--data.pin_memory={keep}"]
        last = i == len(attempts) - 1
        # The delay lets a kill land mid-epoch; the last attempt is not killed, so it runs
        # its remaining steps at full speed.
        proc = start(cmd, logs[i], **({} if last else {"DISTTRAIN_FAULT": SLOW}))
        try:
            if last:
                assert proc.wait(timeout=240) == 0, logs[i].read_text()[-3000:]
                break
            mark = max((m["step"] for m in metrics(tmp_path)), default=0)
            wait_for(lambda proc=proc, nproc=nproc, mark=mark: proc.poll() is not None or any(
                m["world_size"] == int(nproc) and m["step"] > mark + 6 for m in metrics(tmp_path)),
                240, f"attempt {i} training", [logs[i]])
            assert proc.poll() is None, logs[i].read_text()[-3000:]  # refused or failed: it ended
        finally:
            kill_node(proc)
            proc.wait(timeout=30)
    for log in logs[1:]:
        assert "resumed at step" in log.read_text(), log.read_text()[-3000:]
    timeline = audit_timeline(tmp_path)
    assert sorted(timeline) == list(range(1, 49))  # one epoch: 384 chunks, 8 per step
    counts = Counter(i for step in timeline.values() for i in step)
    assert sorted(counts) == list(range(384)) and set(counts.values()) == {1}
    worlds = [m["world_size"] for m in metrics(tmp_path)]
    assert 1 in worlds and worlds[-1] == 2


@pytest.mark.timeout(300)
def test_etcd_down_under_a_running_job_costs_nothing_until_it_answers_again(tmp_path):
    """The job's etcd stops for longer than the agent's poll of waiting nodes, then starts
    again on the same data: the job trains on through the outage, says once that the
    etcd does not answer and once that it answers again, and ends with exit 0 (torch's
    agent alone ends the job at the first poll the etcd misses)."""
    server = EtcdServer().start()
    log = tmp_path / "agent.txt"
    agent = None
    try:
        flags = ("--nnodes", "1:2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                 server.endpoint, "--rdzv-id", "job-outage", "--max-restarts", "3")
        agent = start(trainer_cmd(tmp_path, "--train.steps=30", run_flags=flags), log,
                      DISTTRAIN_FAULT=SLOW)
        wait_for(lambda: any(m["step"] > 3 for m in metrics(tmp_path)), 150, "training", [log])
        server.stop(remove_data=False)
        wait_for(lambda: "does not answer" in log.read_text(), 30, "the outage's line", [log])
        mark = max(m["step"] for m in metrics(tmp_path))
        wait_for(lambda: max(m["step"] for m in metrics(tmp_path)) > mark + 2, 60,
                 "progress while the etcd is down", [log])
        server.start()
        wait_for(lambda: "answers again" in log.read_text(), 30, "the line of its return", [log])
        assert agent.wait(timeout=150) == 0, log.read_text()[-3000:]
    finally:
        if agent is not None:
            kill_node(agent)
        server.stop()
    text = log.read_text()
    assert text.count("does not answer") == 1 and text.count("answers again") == 1, text[-3000:]
    assert max(m["step"] for m in metrics(tmp_path)) == 30
