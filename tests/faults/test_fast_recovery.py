"""`[elastic] fast_recovery`: a killed worker is replaced by a warm spare and the state
comes from the survivors' memory, under a real torchrun with real SIGKILLs. Each run
must end bit-identical to an uninterrupted one, every sample exactly once. Every wait
has a timeout: a hang fails the test."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import built_once, launch_worker, worker_env
from elastic_helpers import (
    assert_same_fast_run,
    audit_timeline,
    descendants,
    kill_node,
    metrics,
    run_trainer,
    start,
    trainer_cmd,
    wait_for,
)

from disttrain.config import load_config
from disttrain.errors import ConfigError
from disttrain.launch.etcd_server import EtcdServer

STEPS = 24
FAST = ("--elastic.fast_recovery=true", "--checkpoint.every=3")
PHASES = ["forward", "backward", "step", "checkpoint.shards"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run (plain torchrun path, no supervisor)."""
    def run(out: Path) -> Path:
        log = out / "log.txt"
        proc = start(trainer_cmd(out, f"--train.steps={STEPS}", "--checkpoint.every=3"), log)
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        return out

    return built_once(tmp_path_factory, "fast-recovery-ref", run)


def run_fast(out: Path, spec: str, timeout: float = 240) -> str:
    log = out / "log.txt"
    proc = start(trainer_cmd(out, f"--train.steps={STEPS}", *FAST), log, DISTTRAIN_FAULT=spec)
    assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]
    return log.read_text()


def assert_same_run(ref: Path, out: Path) -> None:
    assert_same_fast_run(ref, out, steps=STEPS, samples_per_step=8)  # 4 samples a rank a step


def test_kill_9_at_random_points_and_in_quick_succession(reference, tmp_path):
    """Two kill -9 at random (step, phase, rank) points, then three in quick succession:
    rank 1 dies in step 19; rank 0 dies while the newcomer redoes it (the state lives on
    in the newcomer, which received it a moment before); then that newcomer dies while
    handing the state over, so no rank holds it and the disk checkpoint of step 18 is
    loaded. Each death is taken over by a warm spare: no torchrun restart."""
    seed = int(os.environ.get("DISTTRAIN_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    points = []
    for s in sorted(rng.sample(range(2, 16), 2)):
        phase = rng.choice(PHASES)
        if phase.startswith("checkpoint"):  # saves happen at multiples of 3 (step 0 has none)
            s = max(3, s - s % 3)
        if points and s <= points[-1][0]:  # the recovered attempt starts after the first fault's step
            s, phase = points[-1][0] + 1, "forward"
        points.append((s, phase, rng.randrange(2)))
    points += [(19, "backward", 1), (19, "forward", 0), (18, "recovery", 1)]
    print(f"fault seed {seed}: {points}")
    spec = ";".join(f"kill@{phase}:rank={rank},step={s},restart={k}" for k, (s, phase, rank) in enumerate(points))
    text = run_fast(tmp_path, spec)
    assert text.count("disttrain fault: kill") == 5, f"seed {seed}"
    # rank 1's second and third deaths may come within `REPLACE_AFTER_S` of a take-over:
    # a spare started then takes over, and the line says so
    assert text.count("took over and the job goes on from memory") == 5, f"seed {seed}"
    # The last holder of the state dies while handing it over: the disk checkpoint of step 18.
    assert "no rank holds the state in memory; loading the newest checkpoint" in text
    assert "resumed at step 18" in text
    assert "will restart worker group" not in text  # torchrun saw nothing
    assert_same_run(reference, tmp_path)


def _spares(root_pid: int) -> list[int]:
    found = []
    for pid in descendants(root_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"DISTTRAIN_FAST_ROLE=spare" in env.split(b"\0"):
            found.append(pid)
    return found


def test_killed_spare_is_replaced_and_then_used(reference, tmp_path):
    """kill -9 of a waiting spare: its supervisor starts another; a later worker kill
    is still recovered in memory."""
    log = tmp_path / "log.txt"
    agent = start(trainer_cmd(tmp_path, f"--train.steps={STEPS}", *FAST), log,
                  DISTTRAIN_FAULT="kill@step:rank=1,step=18;delay@step:ms=150")
    try:
        wait_for(lambda: any(m["step"] >= 3 for m in metrics(tmp_path)), 120, "step 3", [log])
        victims = _spares(agent.pid)
        assert len(victims) == 2, f"expected a spare per slot, found {victims}"
        os.kill(victims[0], signal.SIGKILL)
        assert agent.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
    text = log.read_text()
    assert "spare exited (-9); starting another" in text
    assert text.count("its warm spare took over") == 1
    assert_same_run(reference, tmp_path)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_lost_node_0_shrinks_the_job_in_memory(tmp_path, strategy):
    """Two agents of one rank each (two "nodes" on loopback) under the etcd rendezvous.
    kill -9 of the whole process tree (agent, supervisor, training process, spare) of
    the node that holds rank 0: the rendezvous and fast recovery's store live in etcd,
    the lost slot's supervisor stops beating, and the survivor goes on at world 1 from
    its own memory (no torchrun restart, no disk), the global batch kept by
    accumulation. Then its training process is killed in step 18: its spare takes over
    in the next generation (alone at world 1 nobody holds the state: the disk
    checkpoint). Under FSDP the shrunk generation reshards the disk checkpoint (the
    buddy copies of world 2 do not fit world 1, where none is kept). The job ends by
    itself, exit 0, the launcher's last line saying so. Every sample of the run is
    consumed exactly once."""
    steps = 24
    with EtcdServer().start() as server:
        flags = ("--nnodes", "2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                 "--rdzv-id", "shrink")
        cmd = trainer_cmd(tmp_path, f"--train.steps={steps}", *FAST, f"--parallel.strategy={strategy}",
                          run_flags=flags)
        logs = [tmp_path / f"node{i}.txt" for i in range(2)]
        fault = "delay@step:ms=150;kill@backward:rank=0,step=18,restart=1"  # in generation 1, the shrunk one
        env = {"DISTTRAIN_FAULT": fault, "DISTTRAIN_JOB_SECRET": "ab" * 32}
        nodes = [start(cmd, log, **env) for log in logs]
        try:
            wait_for(lambda: any(m["step"] >= 6 for m in metrics(tmp_path)), 150, "step 6 at world 2", logs)
            t_kill, mark = time.monotonic(), max(m["step"] for m in metrics(tmp_path))
            node0 = next(i for i, log in enumerate(logs) if "rank 0 (local rank 0) is pid" in log.read_text())
            kill_node(nodes[node0])
            killed = max(m["step"] for m in metrics(tmp_path))  # a loaded host commits steps while it kills
            wait_for(lambda: any(m["world_size"] == 1 for m in metrics(tmp_path)), 60, "world 1 in memory", logs)
            print(f"kill -> first step at world 1: {time.monotonic() - t_kill:.2f} s")
            # the survivor's agent waits at torchrun's exit barrier for the agents left only
            assert nodes[1 - node0].wait(timeout=120) == 0, logs[1 - node0].read_text()[-4000:]
        finally:
            for node in nodes:
                kill_node(node)
    assert (tmp_path / "model.pt").exists() and metrics(tmp_path)[-1]["step"] == steps
    full = logs[1 - node0].read_text()
    assert full.rstrip().splitlines()[-1] == (
        "disttrain run: finished at world 1: rank(s) [0] were lost with their node and the others went on "
        "without them in memory, with no torchrun restart.")
    text, _, later = full.partition("its warm spare took over")
    assert "rank(s) [0] lost with their supervisors" in text and "the job goes on in memory at world 1" in text
    if strategy == "ddp":
        assert "generation 1: state of step" in text and "taken from rank 0's memory" in text  # the survivor's
        assert "loading the newest checkpoint" not in text
    else:
        assert "generation 1: the world changed (2 -> 1 ranks); step" in text
        assert "resharded from the buddy copies in memory" in text and "disk checkpoint" not in text
    assert "world size is now 1: accum_steps 1 -> 2 keeps the global batch at 8" in text
    assert "generation 2: no rank holds the state in memory; loading the newest checkpoint" in later
    assert "will restart worker group" not in text + later
    records = metrics(tmp_path)
    assert {m["world_size"] for m in records if m["step"] > killed + 1} == {1}
    timeline = audit_timeline(tmp_path)
    assert sorted(timeline) == list(range(1, steps + 1))
    counts = Counter(i for step in timeline.values() for i in step)
    assert set(counts.values()) == {1}  # no sample twice; the global batch stayed 8
    # A node killed after a step's gradients were reduced but before its audit line was
    # written leaves that step committed with the survivor's line only: its 4 samples
    # were trained and are not in the audit. At most one such step, at the kill.
    short = [s for s, idx in timeline.items() if len(idx) != 8]
    assert len(counts) == steps * 8 or (len(short) == 1 and len(timeline[short[0]]) == 4
                                        and mark - 1 <= short[0] <= killed + 2), (short, len(counts))


def test_a_lost_node_is_taken_over_by_a_hot_spare_node_bit_exactly(tmp_path):
    """Two training nodes of one rank each and one hot-spare node (`--spare-nodes 1`), FSDP,
    under the etcd rendezvous. kill -9 of the whole process tree of the node that holds
    rank 1 at step 8: the spare node's slot, warm and standing by, takes rank 1's place
    in memory (its shard from the buddy copy on the other node), with no torchrun
    restart and no disk. The run ends bit-identical to an uninterrupted one at world 2,
    every sample once, and every agent left ends by itself with exit 0."""
    ref, out = tmp_path / "ref", tmp_path / "spare"
    ref.mkdir()
    run_trainer(ref, f"--train.steps={STEPS}", "--checkpoint.every=3", "--parallel.strategy=fsdp",
                run_flags=("--nproc", "2"))
    with EtcdServer().start() as server:
        flags = ("--nnodes", "2", "--spare-nodes", "1", "--nproc", "1", "--rdzv-backend", "etcd",
                 "--rdzv-endpoint", server.endpoint, "--rdzv-id", "spare")
        cmd = trainer_cmd(out, f"--train.steps={STEPS}", *FAST, "--parallel.strategy=fsdp", run_flags=flags)
        logs = [tmp_path / f"node{i}.txt" for i in range(3)]
        env = {"DISTTRAIN_FAULT": "delay@step:ms=100", "DISTTRAIN_JOB_SECRET": "ef" * 32,
               # what an outer job left in the environment changes nothing: its slot count
               # would make a probe wait for standby slots that do not exist, its lease a minute
               "DISTTRAIN_TOTAL_SLOTS": "9", "DISTTRAIN_TRAINING_WORLD": "5", "DISTTRAIN_NODE_LEASE_S": "60"}
        nodes = [start(cmd, log, **env) for log in logs]
        try:
            wait_for(lambda: any(m["step"] >= 8 for m in metrics(out)), 150, "step 8", logs)
            lost = next(i for i, log in enumerate(logs) if "rank 1 (local rank 0) is pid" in log.read_text())
            kill_node(nodes[lost])
            left = [i for i in range(3) if i != lost]
            for i in left:
                assert nodes[i].wait(timeout=120) == 0, logs[i].read_text()[-4000:]
        finally:
            for node in nodes:
                kill_node(node)
    text = "".join(logs[i].read_text() for i in left)
    # the killed supervisor's host refuses a connection to it: no lease to wait for
    assert "rank(s) [1] lost with their supervisors (their node refused a connection to them: its processes " \
        "are gone); hot-spare slot(s) [2] take their places and the job goes on in memory at world 2" in text
    assert "will restart worker group" not in text and "loading the newest checkpoint" not in text
    for i in left:
        assert logs[i].read_text().rstrip().splitlines()[-1] == (
            "disttrain run: finished at world 2: rank(s) [1] were lost with their node and hot-spare slot(s) [2] "
            "took their places in memory, with no torchrun restart.")
    assert_same_run(ref, out)


@pytest.mark.parametrize("strategy", ["zero1", "fsdp1"])
def test_fast_recovery_refuses_other_strategies(strategy):
    with pytest.raises(ConfigError, match=rf"'ddp' or 'fsdp', not '{strategy}' on cpu"):
        load_config("examples/tiny_gpt.toml", ["--elastic.fast_recovery=true", f"--parallel.strategy={strategy}"])


@pytest.mark.parametrize("override", ["--parallel.device=cuda", "--parallel.device=auto"])
def test_fast_recovery_accepts_gpus_mocked_cuda(override, monkeypatch):
    """CUDA is mocked (two visible devices); the rule is pure config validation: a GPU
    run is accepted (and says at its start that NCCL recovery is unproven)."""
    import disttrain.config.schema as schema

    monkeypatch.setattr(schema, "_cuda_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config("examples/tiny_gpt.toml", ["--elastic.fast_recovery=true", "--parallel.nproc=2", override])
    assert cfg.elastic.fast_recovery


def test_supervisor_outside_torchrun_says_how_to_start_it():
    env = {k: v for k, v in worker_env().items() if k not in ("RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "disttrain.launch.slot_supervisor", "disttrain.train", "x.toml"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "runs under torchrun" in out.stderr and "Traceback" not in out.stderr


def test_disttrain_run_starts_a_supervisor_per_slot_only_when_asked():
    from disttrain.launch.run_command import torchrun_for

    base = ["--nproc", "2", "-m", "disttrain.train", "examples/tiny_gpt.toml"]
    args = torchrun_for([*base, "--elastic.fast_recovery=true"]).args
    assert args[-4:-2] == ["disttrain.launch.slot_supervisor", "disttrain.train"] and "-m" in args
    args = torchrun_for(base).args
    assert "disttrain.launch.slot_supervisor" not in args


def test_a_generation_drops_only_the_slots_whose_supervisors_stopped_beating(monkeypatch, tmp_path):
    """In one process, on an in-memory store: of a 4-rank job, slots 0 and 2 join
    generation 1; slot 3's supervisor still beats (its spare is coming) and slot 1's
    stopped. Slot 1 is dropped, slot 3 waited for: the roster is [0, 2, 3], ranks follow
    it, and slot 1 coming back later is told it was left out, and takes torchrun's
    restart path."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain import worker_notes
    from disttrain.elastic import fast_recovery, job_store, membership
    from disttrain.launch.end_lines import restart_path_line
    from disttrain.runtime import job_secret

    monkeypatch.setattr(membership, "LEASE_S", 0.3)
    monkeypatch.setattr(membership, "STALL_S", 0.05)
    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=20))
    store = job_store.JobStore(raw, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    for slot in range(4):
        store.add(f"disttrain/fast/alive/{slot}", 1)  # every supervisor has beaten before
    stop = threading.Event()
    beating = threading.Thread(target=membership.beat, args=(store, 3, stop), daemon=True)
    beating.start()
    got: dict[int, tuple[int, list[int]]] = {}

    def member(slot: int) -> None:
        got[slot] = fast_recovery.join(store, 1, slot, 4, wait_s=20)

    threads = [threading.Thread(target=member, args=(s,)) for s in (0, 2)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # several leases: slot 1 is dropped, slot 3 (beating) is not
    assert not got and membership.roster(store, 4) == [0, 2, 3]
    member(3)  # the spare of slot 3 arrives
    for t in threads:
        t.join(timeout=20)
    stop.set()
    assert got == {0: (1, [0, 2, 3]), 2: (1, [0, 2, 3]), 3: (1, [0, 2, 3])}
    assert store.add(membership.LOST_KEY, 0) == 1
    with pytest.raises(membership.LeftOut, match="rank 1 was taken for gone"):
        fast_recovery.join(store, 1, 1, 4, wait_s=5)
    # Under `disttrain run` (its notes folder) slot 1's training process leaves for
    # torchrun's restart path: exit 1, not the program's error, and the launcher says so.
    notes = tmp_path / "notes"
    notes.mkdir()
    for key, value in {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "0", fast_recovery.ROLE_ENV: "first",
                       worker_notes.NOTES_ENV: str(notes), worker_notes.TRACES_ENV: str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(fast_recovery, "connect_store", lambda timeout_s: store)
    with pytest.raises(SystemExit) as leaving:
        fast_recovery.run(lambda info, handoff: None, backend="gloo", device="cpu", timeout_s=5, seed=0)
    assert leaving.value.code == 1 and worker_notes.read_not_retried(notes) is None
    left = worker_notes.read_restart_path(notes)
    assert restart_path_line(left).startswith(
        "finished; rank 1 left fast recovery (rank 1 was taken for gone in generation 1 (its supervisor missed "
        "its beats for 0.3 s) and the job went on without it) and took torchrun's restart path")
    assert "no restart left; give --max-restarts N" in restart_path_line(left, restarted=False)


def test_a_standby_slot_that_beats_takes_a_lost_slots_place(monkeypatch):
    """In one process, on an in-memory store: a job of 2 training slots and 2 hot-spare
    slots (2 and 3). Slot 1's supervisor stopped beating; of the spares only slot 3 beats
    (slot 2's node is gone too). Slot 0 waits in generation 1: slot 3 takes rank 1's
    place, the world stays 2, and the slots gone are kept for the launcher."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain.elastic import fast_recovery, job_store, membership
    from disttrain.runtime import job_secret

    monkeypatch.setattr(membership, "LEASE_S", 0.3)
    monkeypatch.setenv(fast_recovery.TOTAL_SLOTS_ENV, "4")
    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=20))
    store = job_store.JobStore(raw, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    for slot in range(4):
        store.add(f"disttrain/fast/alive/{slot}", 1)
    stop = threading.Event()
    threading.Thread(target=membership.beat, args=(store, 3, stop), daemon=True).start()
    got: dict[int, tuple[int, list[int]]] = {}
    first = threading.Thread(target=lambda: got.setdefault(0, fast_recovery.join(store, 1, 0, 2, wait_s=20)))
    first.start()
    deadline = time.monotonic() + 10
    while membership.roster(store, 2) == [0, 1] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert membership.roster(store, 2) == [0, 3] and not got
    got[3] = fast_recovery.join(store, 1, 3, 2, wait_s=20)  # slot 3's spare, promoted, arrives
    first.join(timeout=20)
    stop.set()
    assert got == {0: (1, [0, 3]), 3: (1, [0, 3])}
    assert membership.gone(store) == [1] and store.add(membership.LOST_KEY, 0) == 0
    assert membership.standby_slots(store, 2, 4) == [2]  # not beating, but not taken for gone either


@pytest.mark.parametrize(("members", "lost", "standby", "after"), [
    ([0, 1, 2, 3], [2, 3], [4, 5], [0, 1, 4, 5]),  # a node of two, replaced in place
    ([0, 1, 2, 3], [0, 1], [4], [4, 2, 3]),  # one spare for two places: the other is dropped
    ([0, 1], [1], [], [0]),  # no spare: the world shrinks
])
def test_a_roster_fills_lost_places_with_spares_in_order(members, lost, standby, after):
    from disttrain.elastic.membership import replaced

    assert replaced(members, lost, standby) == after


@pytest.mark.parametrize(("flags", "words"), [
    (["--nnodes", "2", "--spare-nodes", "x"], "--spare-nodes is 'x'; give the number of standby nodes"),
    (["--nnodes", "1:2", "--spare-nodes", "1"], "--nnodes is '1:2'; give --nnodes N"),
    (["--nnodes", "1", "--spare-nodes", "1"], "give --rdzv-backend etcd --rdzv-endpoint HOST:PORT"),
])
def test_spare_nodes_refuses_what_it_cannot_use(flags, words):
    from disttrain.errors import UserError
    from disttrain.launch.run_command import torchrun_for

    with pytest.raises(UserError, match=re.escape(words)):
        torchrun_for([*flags, "--nproc", "1", "-m", "disttrain.train", "examples/tiny_gpt.toml",
                      "--elastic.fast_recovery=true"])


def test_spare_nodes_needs_fast_recovery_and_starts_the_spares_too(monkeypatch):
    from disttrain.errors import UserError
    from disttrain.launch.run_command import torchrun_for

    flags = ["--nnodes", "2", "--spare-nodes", "1", "--nproc", "2", "--rdzv-backend", "etcd",
             "--rdzv-endpoint", "127.0.0.1:2379"]
    with pytest.raises(UserError, match="--spare-nodes needs fast recovery"):
        torchrun_for([*flags, "-m", "disttrain.train", "examples/tiny_gpt.toml"])
    monkeypatch.setenv("DISTTRAIN_JOB_SECRET", "ab" * 32)
    run = torchrun_for([*flags, "-m", "disttrain.train", "examples/tiny_gpt.toml", "--elastic.fast_recovery=true"])
    assert run.args[run.args.index("--nnodes") + 1] == "3" and "--spare-nodes" not in run.args
    assert run.env["DISTTRAIN_TRAINING_WORLD"] == run.env["DISTTRAIN_EXPECTED_WORLD_SIZE"] == "4"


def test_a_spare_after_a_failure_without_a_death_starts_a_new_generation():
    """In one process, on an in-memory store: both ranks of generation 0 move on to
    generation 1 after a collective failed with nobody dead (no newcomer bumped the
    counter). A spare promoted afterwards bumps the counter onto generation 1, finds it
    full without it, and starts generation 2, where the survivor meets it."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain.elastic import fast_recovery, job_store
    from disttrain.runtime import job_secret

    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=20))
    store = job_store.JobStore(raw, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    got: dict[int, tuple[int, list[int]]] = {}

    def member(slot: int, gen: int) -> threading.Thread:
        t = threading.Thread(target=lambda: got.__setitem__(slot, fast_recovery.join(store, gen, slot, 2, 20)))
        t.start()
        return t

    for t in [member(0, 1), member(1, 1)]:
        t.join(timeout=20)
    assert got == {0: (1, [0, 1]), 1: (1, [0, 1])}
    newcomer = member(1, store.add(fast_recovery.GEN_KEY, 1))  # slot 1's spare: the counter said 0
    deadline = time.monotonic() + 20
    while store.add(fast_recovery.GEN_KEY, 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    survivor = member(0, max(2, store.add(fast_recovery.GEN_KEY, 0)))  # as `fast_recovery.run` goes on
    for t in (newcomer, survivor):
        t.join(timeout=20)
    assert got == {0: (2, [0, 1]), 1: (2, [0, 1])}


def test_a_standby_slot_promotes_its_spare_when_named_and_ends_when_the_job_does(monkeypatch, tmp_path):
    """`slot_supervisor._stand_by` on an in-memory store, its spare a real child process
    that waits on its stdin: named in the roster, the spare gets its line and becomes the
    slot's training process; when every rank of the roster is done instead, the spare is
    ended, the store's host is told, and the slot notes for its launcher that it stood by."""
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain import worker_notes
    from disttrain.elastic import job_store, membership
    from disttrain.launch import slot_supervisor
    from disttrain.runtime import job_secret

    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=20))
    store = job_store.JobStore(raw, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    monkeypatch.setattr(job_store, "connect", lambda timeout_s: store)
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's: 2 slots that train, 2 that stand by
    spare = [sys.executable, "-c", "import sys; sys.exit(0 if sys.stdin.readline().strip() == 'go' else 3)"]
    store.set(membership.ROSTER_KEY, "[0, 2]")  # slot 2 takes slot 1's place
    promoted = slot_supervisor._stand_by(spare, 2, 2, [])
    assert promoted is not None and promoted.wait(timeout=60) == 0
    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv(worker_notes.NOTES_ENV, str(notes))
    monkeypatch.setenv("LOCAL_RANK", "0")
    store.set(membership.ROSTER_KEY, "[0, 1]")
    store.add(membership.DONE_KEY, 2)
    assert slot_supervisor.supervise(spare, 3, 2) == 0  # slot 3 stands by until the job is over
    assert store.add(membership.STANDBY_DONE_KEY, 0) == 1 and worker_notes.read_stood_by(notes)


_NEXT_SPARE = """
import json, subprocess, sys, time
from disttrain.launch import slot_supervisor as s
spare = [sys.executable, "-c", "import sys; sys.exit(0 if sys.stdin.readline().strip() == 'go' else 3)"]
promoted, who = s._promote(spare, None)  # a death before the next spare started: one started now
got = {"promoted": promoted.wait(timeout=60), "warm": who == "its warm spare"}
slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
got["none_ended"] = s._wait_child(time.monotonic() + 0.2)  # time for the next spare
quick = subprocess.Popen([sys.executable, "-c", "pass"])
pid, _ = s._wait_child(time.monotonic() + 60)
got["ended_first"] = pid == quick.pid
slow.kill()
got["blocking"] = s._wait_child(None)[0] == slow.pid
print(json.dumps(got))
"""


def test_a_slot_promotes_a_spare_started_at_once_and_waits_for_its_next_spares_time():
    """After a promotion the slot's next spare starts only `REPLACE_AFTER_S` later: its
    wait for a child returns when one ends, or with none once that time has come; a
    death before then is taken over by a spare started at once and promoted. Run in a
    process of its own: the wait reaps any child of the process."""
    out = subprocess.run([sys.executable, "-c", _NEXT_SPARE], capture_output=True, text=True, timeout=120,
                         env=worker_env(WORLD_SIZE="2"))  # torchrun's, which a spare's environment carries
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"promoted": 0, "warm": False, "none_ended": [0, 0], "ended_first": True, "blocking": True}, got


@pytest.mark.parametrize(("world", "total"), [(2, 2), (2, 3)])
def test_the_last_slot_out_removes_the_rounds_keys_from_a_store_that_keeps_them(world, total):
    """`membership.finish` on an in-memory store standing in for etcd (which keeps keys after
    the job): the keys go when the last slot counts itself out, whichever node it is on
    (node 0 may be lost), and not before: training ranks first, then each hot-spare slot
    still standing by."""
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain.elastic import job_store, membership
    from disttrain.runtime import job_secret

    class KeepsKeys:  # etcd's part that matters here: keys stay until removed
        def __init__(self):
            self.raw, self.removed = dist.HashStore(), 0
            self.raw.set_timeout(timedelta(seconds=5))

        def __getattr__(self, name):
            return getattr(self.raw, name)

        def remove_all(self):
            self.removed += 1

    kept = KeepsKeys()
    store = job_store.JobStore(kept, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    membership.finish(store, world, total)
    assert kept.removed == 0
    membership.finish(store, world, total)
    assert kept.removed == (1 if total == world else 0)
    if total > world:
        membership.finish(store, world, total, standby=True)
        assert kept.removed == 1


def test_a_spare_node_lost_while_standing_by_is_not_waited_for_at_the_exit_barrier(monkeypatch):
    """In one process, on an in-memory store: a job of one training slot (0) and two
    hot-spare nodes of one slot each (1 beats, 2 does not). At the job's end the training
    rank finds slot 2 dead within one lease; the launcher's count of agents gone at the
    exit barrier includes slot 2's node and not slot 1's (a hang of torch's 300 s
    otherwise); a standby slot that reads it later notes the same for its own launcher."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from disttrain import worker_notes
    from disttrain.elastic import job_store, membership
    from disttrain.launch import notes_watch
    from disttrain.runtime import job_secret

    monkeypatch.setattr(membership, "LEASE_S", 0.3)
    raw = dist.HashStore()
    raw.set_timeout(timedelta(seconds=5))
    store = job_store.JobStore(raw, job_secret.from_env({job_secret.SECRET_ENV: job_secret.new_secret()}))
    stop = threading.Event()
    threading.Thread(target=membership.beat, args=(store, 1, stop), daemon=True).start()
    store.add("disttrain/fast/alive/2", 1)  # beat once, then its node was lost
    assert membership.dead_standby(store, 1, 3) == [2]
    stop.set()
    assert membership.found_dead_standby(store) == [2]
    monkeypatch.setenv("LOCAL_RANK", "0")  # a worker's side of the notes
    watch = notes_watch.watch()  # the launcher's
    try:
        assert watch.agents_gone(1) == 0
        worker_notes.note_standby_lost(membership.found_dead_standby(store))
        assert watch.agents_gone(1) == 1
    finally:
        watch.close()


def test_fsdp_shards_of_four_ranks_are_rebuilt_exactly_for_two_from_the_buddy_packs(tmp_path):
    """The reshard a shrink under FSDP does in memory (`elastic.buddy_reshard`), on real
    FSDP2 shards of uneven sizes: the packs of 4 ranks, rebuilt for a mesh of 2, give
    every parameter and Adam moment back bit for bit (tests/workers/reshard_checks.py)."""
    results = launch_worker("reshard_checks.py", 4, tmp_path)
    for r in results[:2]:
        assert r["same"] is True and r["step"] == 2, r
    assert results[0]["uneven"][0] != results[1]["uneven"][0], results  # the pieces of a 3-row weight differ


def test_a_restore_loads_fsdp_shards_in_place_and_a_salvage_keeps_the_older_pack(tmp_path):
    """Two parts of an in-memory restore under FSDP (tests/workers/restore_parts.py):
    a pack loaded back gives every parameter and Adam moment bit for bit, written into
    the storage FSDP trains; and a buddy whose newest copy arrived as the generation
    failed keeps the one before too, so a step held for every shard remains when another
    buddy's newest copy was cut off by the same loss."""
    results = launch_worker("restore_parts.py", 2, tmp_path)
    for r in results:
        assert r["same"] is True and r["kept_storage"] is True, r
        assert r["theirs"] == [1, 2], r


def test_a_process_at_another_rank_of_an_equal_world_places_its_shards_at_the_new_rank(tmp_path):
    """After a shrink and a join a process may train at another rank of a world of the
    same size, with the same shapes. torch caches each DTensor operator's sharding plan
    with the mesh it first saw, and that mesh's coordinate; `dt.init` at a new place
    forgets them, so the shards, the Adam moments and a DCP save follow the new rank
    (tests/workers/rank_moves.py: two ranks trade places between two groups)."""
    results = launch_worker("rank_moves.py", 2, tmp_path)
    for r in results:
        assert r["parameters"] == [r["rank"]] and r["moments"] == [r["rank"]], r
        assert r["save_error"] == "", r
