"""A node that joins a running fast-recovery job (`disttrain run --join`): admitted at a
step boundary, its state from the running ranks' memory, no torchrun restart. Real
agents on one host under the etcd rendezvous; every wait has a timeout."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from elastic_helpers import audit_timeline, kill_node, load_params, metrics, run_trainer, start, trainer_cmd, wait_for

from disttrain.elastic import etcd_store, join_node
from disttrain.errors import UserError
from disttrain.launch.end_lines import shrunk_line
from disttrain.launch.etcd_server import EtcdServer
from disttrain.launch.join_flags import RUN_ENV, take_join
from disttrain.launch.run_command import torchrun_for

STEPS, STOP_AT = 24, 8
SECRET = "ab" * 32
JOB = ("--elastic.fast_recovery=true", "--checkpoint.every=1", "--checkpoint.keep_last=30",
       "--train.batch_size=2", "--train.accum_steps=2", "--parallel.strategy=fsdp")
WAIT = ("--guard.hang_min_s=240",)  # the joiner starts while rank 0 is stopped: slow on a loaded host


def _clean_start(cmd: list[str], log, **env: str):
    """`start` with none of the launch variables an earlier in-process launch or training
    run of this test process may have left in its environment (each node starts clean)."""
    leftover = [k for k in os.environ if k.startswith(("DISTTRAIN_", "TORCHELASTIC_", "PET_")) or k in LAUNCH_VARS]
    with pytest.MonkeyPatch.context() as mp:
        for key in leftover:
            mp.delenv(key, raising=False)
        return start(cmd, log, **env)


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _stacks(proc) -> str:
    """Every process of a node that did not get ready, as py-spy sees it (for the failure's message)."""
    import subprocess

    from elastic_helpers import descendants

    out = []
    for pid in [proc.pid, *descendants(proc.pid)]:
        spy = Path(sys.executable).with_name("py-spy")  # the test extras install it beside python
        got = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        out.append(got.stdout[-1500:] or got.stderr[-300:])
    return "\n".join(out)


def _ready(endpoint: str, slots: list[int], run_id: str = "grow") -> bool:
    job = join_node.find_job(run_id, endpoint, wait_s=5)
    store = etcd_store.connect(endpoint, 5, prefix=job.round)
    return all(store.add(f"disttrain/fast/ready/{s}", 0) > 0 for s in slots)


@contextmanager
def _joined_while_stopped(tmp_path: Path, out: Path, joiner_flags: tuple[str, ...] = (), before_join=None):
    """A 1 x 2 job of `JOB` (run id "grow", on an etcd of its own) whose rank 0 is stopped
    (SIGSTOP) at step `STOP_AT`; then a second node of 2 slots, started with the job's
    own command plus --join and `joiner_flags`; rank 0 goes on once that node's warm
    spares stand by. `before_join(endpoint)` runs once the job has started. Yields the
    two agents and their logs; every process is killed on leaving."""
    with EtcdServer().start() as server:
        flags = ("--nnodes", "1", "--nproc", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                 "--rdzv-id", "grow")
        cmd = trainer_cmd(out, f"--train.steps={STEPS}", *JOB, *WAIT, run_flags=flags)
        logs = [tmp_path / "job.txt", tmp_path / "joiner.txt"]
        env = {"DISTTRAIN_JOB_SECRET": SECRET, "DISTTRAIN_FAULT": f"stop@step:rank=0,step={STOP_AT}"}
        nodes = [_clean_start(cmd, logs[0], **env)]
        try:
            wait_for(lambda: "rank 0 (local rank 0) is pid" in logs[0].read_text(), 120, "the job's start", logs)
            rank0 = int(re.search(r"rank 0 \(local rank 0\) is pid (\d+)", logs[0].read_text()).group(1))
            if before_join is not None:
                before_join(server.endpoint)
            wait_for(lambda: any(m["step"] >= STOP_AT - 1 for m in metrics(out)), 120, "rank 0 stopped", logs)
            nodes.append(_clean_start(cmd[:4] + ["--join"] + cmd[4:] + list(joiner_flags), logs[1], **env))
            try:
                wait_for(lambda: _ready(server.endpoint, [2, 3]), 200, "the joined slots' warm spares", logs)
            except AssertionError as e:
                raise AssertionError(f"{e}\n--- the joining node's processes\n{_stacks(nodes[1])}") from None
            time.sleep(0.5)  # past the job's next look for ready slots
            os.kill(rank0, signal.SIGCONT)
            yield nodes, logs
        finally:
            for node in nodes:
                kill_node(node)


def _assert_each_sample_once(out: Path, steps: int) -> None:
    """Every step 1..steps took a global batch of 8 samples, and no sample came twice (one epoch)."""
    timeline = audit_timeline(out)
    assert sorted(timeline) == list(range(1, steps + 1)) and all(len(v) == 8 for v in timeline.values())
    assert max(Counter(i for v in timeline.values() for i in v).values()) == 1


def _assert_same_as_a_restart_from_disk(out: Path, ref: Path, at: int, steps: int, nproc: int) -> None:
    """The disk's way to the same world: `out`'s checkpoint of step `at` resumed by `nproc`
    ranks (in `ref`) ends with the same weights as `out`, bit for bit."""
    (ref / "checkpoints").mkdir(parents=True)
    saved = next(p for p in (out / "checkpoints").iterdir() if p.name.endswith(f"{at:08d}"))
    shutil.copytree(saved, ref / "checkpoints" / saved.name)
    run_trainer(ref, f"--train.steps={steps}", *JOB[1:], run_flags=("--nproc", str(nproc)))
    got, want = load_params(out / "model.pt"), load_params(ref / "model.pt")
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)


def test_a_node_joins_a_running_job_in_memory_as_a_restart_from_disk_would(tmp_path, monkeypatch):
    """A 1 x 2 FSDP job (global batch 8: 2 ranks x 2 samples x 2 micro-batches); rank 0
    is stopped (SIGSTOP) before step 8's update until a second node of 2 slots, started
    with the job's own command plus --join, stands by warm; then it goes on. The joined
    slots are admitted at the step the next preemption vote is read (step 8 or a few
    later): world 4, the shards resharded from the buddy copies in memory, accumulation
    2 -> 1 keeping the global batch. Both agents end by themselves with the line that
    says so; every sample once; and the final weights equal a restart from the disk at
    world 4 from that step's checkpoint, bit for bit. A node with another secret is told
    so at once."""
    monkeypatch.setenv("DISTTRAIN_JOB_SECRET", SECRET)
    out = tmp_path / "grown"

    def another_secret_is_told(endpoint: str) -> None:
        monkeypatch.setenv("DISTTRAIN_JOB_SECRET", "cd" * 32)
        with pytest.raises(UserError, match="another DISTTRAIN_JOB_SECRET"):
            join_node.find_job("grow", endpoint, wait_s=60)
        monkeypatch.setenv("DISTTRAIN_JOB_SECRET", SECRET)

    with _joined_while_stopped(tmp_path, out, before_join=another_secret_is_told) as (nodes, logs):
        for node, log in zip(nodes, logs, strict=True):
            assert node.wait(timeout=150) == 0, log.read_text()[-4000:]
    text = logs[0].read_text()
    admitted = re.search(r"slot\(s\) \[2, 3\] of a node that joined are admitted after step (\d+)", text)
    assert admitted, text[-4000:]
    at = int(admitted.group(1))
    assert STOP_AT <= at < STEPS, at
    assert f"step {at} resharded from the buddy copies in memory" in text
    assert "accum_steps 2 -> 1 keeps the global batch at 8" in text
    assert "will restart worker group" not in text and "loading the newest checkpoint" not in text
    for log in logs:
        assert log.read_text().rstrip().splitlines()[-1] == (
            "disttrain run: finished at world 4: slot(s) [2, 3] of nodes that joined were admitted in memory "
            "with no torchrun restart.")
    _assert_each_sample_once(out, STEPS)
    assert {m["step"] for m in metrics(out)} == set(range(1, STEPS + 1))
    _assert_same_as_a_restart_from_disk(out, tmp_path / "ref", at, STEPS, nproc=4)


def test_a_node_lost_then_a_node_joined_trains_and_saves_at_moved_ranks(tmp_path, monkeypatch):
    """2 nodes x 1 rank, FSDP, a save every step. Node 0 is killed whole: the survivor
    (rank 1) goes on alone in memory, and is stopped (SIGSTOP) at step 12 until a node
    started with the job's command plus --join stands by warm. It is admitted: world 2
    again, the survivor now rank 0. Every save after the admission completes (a process
    that kept its old rank's shard places wrote chunks that overlap), both agents end by
    themselves, every sample is used once, and the final weights equal a restart from
    the disk at world 2 from the admission step's checkpoint, bit for bit."""
    monkeypatch.setenv("DISTTRAIN_JOB_SECRET", SECRET)
    out, steps = tmp_path / "moved", 30
    with EtcdServer().start() as server:
        flags = ("--nnodes", "2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                 "--rdzv-id", "moved")
        cmd = trainer_cmd(out, f"--train.steps={steps}", *JOB, *WAIT, run_flags=flags)
        logs = [tmp_path / f"node{i}.txt" for i in range(3)]
        # the survivor's generation (1) stops at step 12; the first kill comes after step 4
        fault = "delay@step:ms=150;stop@step:rank=0,step=12,restart=1"
        env = {"DISTTRAIN_JOB_SECRET": SECRET, "DISTTRAIN_FAULT": fault}
        nodes = [_clean_start(cmd, log, **env) for log in logs[:2]]
        try:
            wait_for(lambda: any(m["step"] >= 4 for m in metrics(out)), 200, "step 4", logs)
            first = next(i for i in (0, 1) if "rank 0 (local rank 0) is pid" in logs[i].read_text())
            survivor = int(re.search(r"rank 1 \(local rank 0\) is pid (\d+)", logs[1 - first].read_text()).group(1))
            kill_node(nodes[first])
            wait_for(lambda: any(m["world_size"] == 1 and m["step"] >= 11 for m in metrics(out)), 120,
                     "the survivor's stop at step 12", logs)
            nodes.append(_clean_start(cmd[:4] + ["--join"] + cmd[4:], logs[2], **env))
            wait_for(lambda: _ready(server.endpoint, [2], "moved"), 200, "the joined slot's warm spare", logs)
            time.sleep(0.5)  # past the job's next look for ready slots
            os.kill(survivor, signal.SIGCONT)
            for i in (1 - first, 2):
                assert nodes[i].wait(timeout=240) == 0, logs[i].read_text()[-4000:]
        finally:
            for node in nodes:
                kill_node(node)
    text = logs[1 - first].read_text()
    admitted = re.search(r"slot\(s\) \[2\] of a node that joined are admitted after step (\d+)", text)
    assert admitted, text[-4000:]
    at = int(admitted.group(1))
    assert "was not saved" not in text + logs[2].read_text()
    for i in (1 - first, 2):
        assert logs[i].read_text().rstrip().splitlines()[-1].startswith(
            "disttrain run: finished at world 2: slot(s) [2] of nodes that joined were admitted in memory"), i
    _assert_each_sample_once(out, steps)
    _assert_same_as_a_restart_from_disk(out, tmp_path / "ref", at, steps, nproc=2)


def test_a_node_that_joins_with_another_config_is_refused_and_the_job_goes_on(tmp_path, monkeypatch):
    """The user's mistake on the joining node: its command carries another learning rate.
    A 1 x 2 FSDP job is stopped (SIGSTOP) at step 8 until the node stands by warm; it is
    admitted, its ranks and the job's disagree at the start checks, and only the joined
    ranks differ: they are not admitted. The joining node stops with the check's words
    (the differing key, each rank's value) and exit 2; the job is not stopped by it and
    goes on at world 2 from the buddy copies in memory, with no restart and no line
    claiming a growth, and ends with the weights of a run that no node joined, bit for
    bit, every sample once."""
    monkeypatch.setenv("DISTTRAIN_JOB_SECRET", SECRET)
    out, ref = tmp_path / "refused", tmp_path / "ref"
    with _joined_while_stopped(tmp_path, out, joiner_flags=("--optim.lr=0.02",)) as (nodes, logs):
        assert nodes[1].wait(timeout=150) == 2, logs[1].read_text()[-4000:]
        assert nodes[0].wait(timeout=150) == 0, logs[0].read_text()[-4000:]
    joiner, text = logs[1].read_text(), logs[0].read_text()
    assert "this node's rank was not admitted to the running job, which goes on without it" in joiner
    assert "differing keys (1): optim.lr: rank 0=0.01, rank 1=0.01, rank 2=0.02, rank 3=0.02" in joiner, joiner
    assert "Traceback" not in joiner
    assert re.search(r"slot\(s\) \[2, 3\] of a node that joined are admitted after step \d+", text), text[-3000:]
    assert "slot(s) [2, 3] new to the job were not admitted: they differ from it at start (config" in text
    assert re.search(r"the world is 2 ranks again; step \d+ resharded from the buddy copies in memory", text)
    assert "finished at world" not in text and "error" not in text.lower()
    assert "will restart worker group" not in text and "loading the newest checkpoint" not in text
    _assert_each_sample_once(out, STEPS)
    ref.mkdir()
    run_trainer(ref, f"--train.steps={STEPS}", *JOB, run_flags=("--nproc", "2"))
    got, want = load_params(out / "model.pt"), load_params(ref / "model.pt")
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)


@pytest.mark.parametrize("veteran, prints, refused", [
    # the joined ranks 2 and 3 carry another config: refused, with the key that differs
    ([True, True, False, False], [{"config": "a"}] * 2 + [{"config": "b"}] * 2, ([2, 3], ["config"])),
    # one veteran, two newcomers: the veteran's values are the job's, not the majority's
    ([True, False, False], [{"config": "a", "torch": "1"}] + [{"config": "b", "torch": "1"}] * 2, ([1, 2], ["config"])),
    # a newcomer that matches (a killed rank's spare) stays; the one that differs is refused
    ([True, False, False], [{"torch": "1"}, {"torch": "1"}, {"torch": "2"}], ([2], ["torch"])),
    # the job's own ranks disagree: its error, nobody refused
    ([True, True, False], [{"config": "a"}, {"config": "b"}, {"config": "a"}], ([], [])),
    # the first generation: no veteran, the majority's error as before
    ([False, False], [{"config": "a"}, {"config": "b"}], ([], [])),
])
def test_newcomers_that_differ_from_the_veterans_are_the_ones_refused(veteran, prints, refused):
    assert join_node.differing_newcomers(veteran, prints) == refused


@pytest.mark.parametrize("flags, words", [
    (["--join", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"], "the etcd rendezvous"),
    (["--join", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1"], "--rdzv-id ID"),
    (["--join", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1", "--rdzv-id", "x", "--spare-nodes", "1"],
     "leave out --spare-nodes"),
])
def test_join_refuses_what_cannot_find_the_job(flags, words):
    with pytest.raises(UserError, match=re.escape(words)):
        torchrun_for([*flags, "-m", "disttrain.train", "examples/tiny_gpt.toml", "--elastic.fast_recovery=true"])


def test_join_runs_its_own_torchrun_pointed_at_the_job():
    """The joining node's torchrun takes none of the job's node flags (it would enter the
    job's rendezvous and restart every worker); its slots are told the job's run id and etcd."""
    flags = ["--join", "--nnodes=2", "--nproc", "2", "--rdzv-backend", "etcd", "--rdzv_endpoint", "h:2379",
             "--rdzv-id", "job7", "--max-restarts", "3"]
    kept, env = take_join(flags, None, ("etcd", "h:2379", "job7"))
    assert kept == ["--nproc", "2", "--max-restarts", "3"]
    assert env[RUN_ENV] == "job7" and env["DISTTRAIN_FAST_STORE"] == "etcd://h:2379"
    assert take_join(["--nproc", "2"], None, (None, None, None)) == (["--nproc", "2"], {})


def test_a_node_that_is_not_ready_holds_back_no_other():
    """Two nodes join a 2-slot job (slots 2-3 and 4-5): the second is admitted as soon as
    both its slots are ready, while the first still warms up (or was lost before it was
    ready); the first, once ready, is admitted whole; an admitted or gone slot never again."""
    import torch.distributed as dist

    from disttrain.elastic import membership
    from disttrain.elastic.job_store import JobStore

    store = JobStore(dist.HashStore(), b"k" * 32)
    assert join_node.ready(store, 2, [0, 1]) == []  # nobody joined: one read
    assert join_node.reserve(store, "a", 0, 2) == 0 and join_node.reserve(store, "b", 0, 2) == 2  # past slot 1
    for slot in (2, 4, 5):
        join_node.mark_ready(store, slot)
    assert join_node.ready(store, 2, [0, 1]) == [4, 5]  # slot 3 is not ready: node a waits whole
    join_node.mark_ready(store, 3)
    assert join_node.ready(store, 2, [0, 1]) == [2, 3, 4, 5]
    assert join_node.ready(store, 2, [0, 1, 4, 5]) == [2, 3]  # node b admitted already
    store.set(membership.GONE_KEY, "[3]")
    assert join_node.ready(store, 2, [0, 1, 4, 5]) == [2]  # slot 3 lost: its node's other slot


@pytest.mark.parametrize("members, joiners, fits_world, admitted", [
    ([0, 1], [2, 3], lambda w: w in (1, 2, 4), [2, 3]),
    ([0, 1], [2, 3], lambda w: w in (1, 2, 3), [2]),  # one of a node's slots: the other stands by
    ([0, 1], [2, 3], lambda w: w in (1, 2), []),
])
def test_joined_slots_are_admitted_only_as_far_as_the_batch_policy_allows(members, joiners, fits_world, admitted):
    assert join_node.fitting(joiners, members, fits_world) == admitted


def test_the_last_line_of_a_grown_job():
    line = shrunk_line({"world": 4, "lost": [], "spares": [], "joined": [2, 3]})
    assert line == "finished at world 4: slot(s) [2, 3] of nodes that joined were admitted in memory with no " \
        "torchrun restart."
    both = shrunk_line({"world": 4, "lost": [1], "spares": [], "joined": [4, 5]})
    assert "rank(s) [1] lost with their node" in both and "[4, 5] of nodes that joined" in both
