"""What disttrain listens on, and what it accepts from whoever connects: fast recovery's
store (bound to MASTER_ADDR's address, values sealed with the job's secret), the state
a peer sends (JSON and tensors, never a pickle), and `disttrain etcd start` (loopback by
default, gone with the command). Real processes and sockets; every wait has a timeout."""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import worker_env

from disttrain.errors import UserError
from disttrain.launch import run_command
from disttrain.runtime import job_secret


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    """The local addresses listening on TCP `port` in this network namespace."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            address, hex_port = parts[1].split(":")
            if parts[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp prints it (little-endian hosts)


# ---------------------------------------------------------------- the job's secret


def test_disttrain_run_hands_a_fast_recovery_job_a_fresh_secret_in_its_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(job_secret.SECRET_ENV, raising=False)
    script = tmp_path / "job.py"
    script.write_text("")
    runs = [run_command.torchrun_for(["--fast-recovery", "--nproc", "2", str(script)]) for _ in range(2)]
    secrets_made = [r.env[job_secret.SECRET_ENV] for r in runs]
    assert secrets_made[0] != secrets_made[1] and len(bytes.fromhex(secrets_made[0])) == 32
    assert not any(secrets_made[0] in a for a in runs[0].args)  # never on a command line
    assert job_secret.SECRET_ENV not in run_command.torchrun_for(["--nproc", "2", str(script)]).env
    with pytest.raises(UserError, match="same DISTTRAIN_JOB_SECRET on every node"):
        run_command.torchrun_for(
            ["--fast-recovery", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc", "2", str(script)]
        )
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)  # the user's own wins, on every node
    run = run_command.torchrun_for(
        ["--fast-recovery", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--nproc", "2", str(script)]
    )
    assert job_secret.SECRET_ENV not in run.env
    monkeypatch.setenv(job_secret.SECRET_ENV, "not hex")
    with pytest.raises(UserError, match="hex-encoded"):
        run_command.torchrun_for(["--fast-recovery", "--nproc", "2", str(script)])


# ---------------------------------------------------------------- fast recovery's store


def _foreign_client(port: int, prefix: str) -> None:
    """Another user's process: no secret, a plain client of the job's store. It writes
    a list that would make a survivor cut its own store connection (0.0.0.0 matches any
    address), one that does not parse, and a copy of a sealed value under another key."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))
    store.set(f"{prefix}/listen/1", f"0.0.0.0|{port}")
    store.set(f"{prefix}/listen/2", "no|list|at all")
    store.set(f"{prefix}/listen/3", store.get(f"{prefix}/listen/0"))  # replayed under another key


def test_store_listens_on_master_addr_only_and_ignores_a_foreign_clients_values(monkeypatch, caplog):
    import torch.distributed as dist

    from disttrain.elastic import group_sockets, job_store

    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv(job_secret.SECRET_ENV, job_secret.new_secret())
    server = job_store.host_store(timeout_s=20)
    assert _listening(port) == {LOOPBACK}  # torch's own server would listen on every interface
    ours = job_store.connect(timeout_s=20)
    prefix = "disttrain/fast/g0"
    with socket.socket() as group_listener:  # what a gloo group of rank 0 would have opened
        group_listener.bind(("127.0.0.1", 0))
        group_listener.listen(1)
        group_sockets.publish(ours, prefix, 0, before=set())
        mine = ("127.0.0.1", group_listener.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    foreign = ctx.Process(target=_foreign_client, args=(port, prefix))
    foreign.start()
    foreign.join(timeout=60)
    assert foreign.exitcode == 0
    with caplog.at_level("WARNING", logger="disttrain"):
        found = group_sockets.published(ours, prefix, world=4)
    assert mine in found and ("0.0.0.0", port) not in found
    ignored = sorted(
        r.getMessage().split("value of ")[1].split(" on")[0] for r in caplog.records if "ignored" in r.getMessage()
    )
    assert ignored == [f"{prefix}/listen/{r}" for r in (1, 2, 3)]
    assert ours.add("probe", 1) == 1 and isinstance(server, dist.TCPStore)  # the store still serves


def test_store_on_etcd_when_the_rendezvous_is_etcd_seals_values_and_carries_groups(monkeypatch, caplog):
    """Under `--rdzv-backend etcd` fast recovery's store is the etcd (no node hosts it):
    `disttrain run` names it to the ranks; their values are sealed as on the TCP store;
    a generation's gloo group forms on it; the last rank to count itself out removes the
    round's keys (no supervisor hosts the store)."""
    import threading

    import torch.distributed as dist

    from disttrain.elastic import etcd_store, job_store, membership
    from disttrain.launch.etcd_server import EtcdServer

    monkeypatch.setenv(job_secret.SECRET_ENV, job_secret.new_secret())  # several nodes: the user's
    run = run_command.torchrun_for(["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                                    "127.0.0.1:2379", "-m", "disttrain.train", "examples/tiny_gpt.toml",
                                    "--elastic.fast_recovery=true"])
    assert run.env[run_command.FAST_STORE_ENV] == "etcd://127.0.0.1:2379"
    with EtcdServer().start() as server:
        for k, v in {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job",
                     etcd_store.STORE_ENV: f"etcd://{server.endpoint}"}.items():
            monkeypatch.setenv(k, v)
        outsider = etcd_store.connect(server.endpoint, timeout_s=20)  # without the job's secret
        ranks = [job_store.connect(timeout_s=20) for _ in range(2)]
        assert [r.add("joined", 1) for r in ranks] == [1, 2] and outsider.add("joined", 0) == 2
        ranks[0].set("a", "sealed")
        outsider.set("b", "written without the job's secret")
        with caplog.at_level("WARNING", logger="disttrain"):
            assert ranks[1].get("a") == "sealed" and ranks[1].get("b") is None
            assert ranks[1].get("never written") is None  # at once: an absent key is not waited for
        sums = [0.0, 0.0]

        def member(rank: int) -> None:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("g0/pg", ranks[rank].store), rank, 2,
                                       datetime.timedelta(seconds=30))
            x = torch.tensor([rank + 1.0])
            pg.allreduce([x]).wait()
            sums[rank] = x.item()

        threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sums == [3.0, 3.0]
        membership.finish(ranks[1], 2, 2)
        assert ranks[0].store.check(["a"])  # one rank is still in
        membership.finish(ranks[0], 2, 2)
        assert not ranks[0].store.check(["a"])


def test_slot_supervisor_refuses_to_start_without_the_jobs_secret():
    env = {k: v for k, v in worker_env(RANK="0", WORLD_SIZE="1", MASTER_PORT="1").items()
           if k != job_secret.SECRET_ENV}
    out = subprocess.run([sys.executable, "-m", "disttrain.launch.slot_supervisor", "disttrain.train", "x.toml"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "DISTTRAIN_JOB_SECRET is not set" in out.stderr


# ---------------------------------------------------------------- what a peer sends


class _Runs:
    """Runs a command when unpickled: what a pickle from a peer could do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_pack(marker: str) -> torch.Tensor:
    """A buffer in the older pack layout (int64 length, padding, a pickled skeleton)."""
    skeleton = pickle.dumps({"meta": _Runs(marker)})
    buf = torch.zeros(16 + -(-len(skeleton) // 16) * 16, dtype=torch.uint8)
    buf[:8].view(torch.int64)[0] = len(skeleton)
    buf[16 : 16 + len(skeleton)] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    return buf


def _peer(rank: int, port: int, marker: str, out: str) -> None:
    """Rank 1 sends a pickle where a state belongs; rank 0 receives it as a survivor
    does (`broadcast_state`) and writes what happened."""
    import torch.distributed as dist

    from disttrain.elastic.buddy_copy import MalformedPack
    from disttrain.elastic.fast_recovery import broadcast_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        if rank == 1:
            buf = _pickle_pack(marker)
            dist.broadcast(torch.tensor([buf.numel()], dtype=torch.int64), src=1)
            dist.broadcast(buf, src=1)
            return
        try:
            broadcast_state(None, src=1)
            result = "accepted"
        except MalformedPack as e:
            result = f"refused: {e}"
        Path(out).write_text(result)
    finally:
        dist.destroy_process_group()


def test_a_pickle_from_a_peer_is_refused_and_never_run(tmp_path):
    marker, out = tmp_path / "ran", tmp_path / "result"
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, str(marker), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert [p.exitcode for p in procs] == [0, 0]
    assert out.read_text().startswith("refused: the pack's skeleton is not JSON")
    assert not marker.exists()


def test_pack_keeps_int_keys_tuples_and_plain_values_without_pickle():
    from disttrain.elastic.buddy_copy import MalformedPack, pack, unpack

    sd = {"optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.99), "eps": 1e-8,
                                                                             "fused": None, "params": [0]}]},
          "meta": {"step": 3, "nan": math.inf, "flag": True, "name": "x"},
          "empty": torch.empty(0, 4, dtype=torch.bfloat16)}
    back = unpack(pack(sd), None)
    assert back["optim"]["param_groups"] == sd["optim"]["param_groups"] and back["meta"] == sd["meta"]
    assert torch.equal(back["optim"]["state"][0]["step"], torch.tensor(3.0))
    assert back["empty"].shape == (0, 4) and back["empty"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match="cannot be copied without pickle"):
        pack({"device": torch.device("cpu")})
    # a slot that reaches past the buffer, and a dtype that is no dtype: refused
    for slot in ([0, 4096, "float32", [1024], False], [0, 4, "Tensor", [1], False]):
        skeleton = json.dumps({"s": slot}).encode()
        buf = torch.zeros(16 + -(-len(skeleton) // 16) * 16 + 8, dtype=torch.uint8)
        buf[:8].view(torch.int64)[0] = len(skeleton)
        buf[16 : 16 + len(skeleton)] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
        with pytest.raises(MalformedPack):
            unpack(buf, None)


def _send_pickle(marker: str, group=None) -> None:
    """As rank 0: a pickle where a broadcast's JSON belongs (the layout of both torch's
    `broadcast_object_list` and `broadcast_json`: a length, then the bytes)."""
    import torch.distributed as dist

    data = pickle.dumps(_Runs(marker))
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)


def _gather_pickle(marker: str, group=None) -> None:
    """A pickle where an all-gather's JSON belongs (the layout of torch's
    `all_gather_object` and of `all_gather_json`: the lengths, then the padded bytes)."""
    import torch.distributed as dist

    data = pickle.dumps(_Runs(marker))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(t.item()) for t in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in range(2)], mine, group=group)


def _honest(ran: Path, tmp: Path) -> list[str]:
    """Rank 1's side: a resume, a checkpointer's start and load, the guard's start check,
    each fed a pickle by rank 0; what each did."""
    from disttrain.checkpoint.checkpointer import Checkpointer
    from disttrain.checkpoint.state import TrainState
    from disttrain.guard.run_guard import check_consistency
    from disttrain.train.resume_plan import inspect_root

    steps = {
        "resume plan": lambda: inspect_root(tmp, {}),
        "checkpointer's run id": lambda: Checkpointer(tmp),
        "checkpointer's load agreement": lambda: Checkpointer(tmp).load(
            TrainState(model=torch.nn.Linear(2, 2)), tmp / "step-00000001"
        ),
        "guard's fingerprints": lambda: check_consistency(accum_steps=1),
    }
    results = []
    for name, step in steps.items():
        try:
            step()
            results.append(f"{name}: accepted")
        except Exception as e:  # what disttrain raises is the test's to check
            results.append(f"{name}: refused: {type(e).__name__}: {e}")
        results[-1] += " (ran)" if ran.exists() else ""
    return results


def _pickling_peer(rank: int, port: int, tmp: str) -> None:
    """Rank 0 sends a pickle into each of the exchanges rank 1 makes (`_honest`), and
    plays its part honestly where rank 1's side needs it to get there."""
    import torch.distributed as dist

    from disttrain.checkpoint.checkpointer import Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    ran = Path(tmp) / "ran"
    try:
        if rank == 1:
            Path(tmp, "result").write_text("\n".join(_honest(ran, Path(tmp))))
            return
        _send_pickle(str(ran))  # the resume plan
        _send_pickle(str(ran), dist.new_group(backend="gloo"))  # a checkpointer's run id
        pg = Checkpointer(tmp).pg  # an honest start, then a load whose ranks disagree
        dist.all_reduce(torch.tensor([1], dtype=torch.int32), op=dist.ReduceOp.MAX, group=pg)
        _gather_pickle(str(ran), pg)
        _gather_pickle(str(ran))  # the guard's fingerprints
    finally:
        dist.destroy_process_group()


def test_a_pickle_in_a_resume_checkpoint_or_guard_exchange_is_refused_and_never_run(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_pickling_peer, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert [p.exitcode for p in procs] == [0, 0]
    lines = (tmp_path / "result").read_text().splitlines()
    names = ["resume plan", "checkpointer's run id", "checkpointer's load agreement", "guard's fingerprints"]
    assert [line.split(":")[0] for line in lines] == names
    for line in lines:
        assert "refused: MalformedPeerValue: rank 0 sent bytes that are not JSON" in line, line
        assert "(ran)" not in line, line
    assert not (tmp_path / "ran").exists()


def test_a_value_of_another_shape_is_refused_not_used():
    from disttrain.runtime.collectives import MalformedPeerValue, conform
    from disttrain.train.resume_plan import ResumePlan

    plan = ResumePlan("ckpt/step-00000003", 3, {"optim": {"lr": 0.1}}, changes=[("optim.lr", 0.1, 0.2)])
    assert ResumePlan.from_json(json.loads(json.dumps(plan.to_json())), "rank 0") == plan  # tuples back
    for bad in ({**plan.to_json(), "step": "3"}, {**plan.to_json(), "changes": [["optim.lr", 1]]},
                {**plan.to_json(), "extra": 1}, ["ckpt", 3]):
        with pytest.raises(MalformedPeerValue, match=r"rank 0 \(its resume plan\) sent"):
            ResumePlan.from_json(bad, "rank 0")
    problem = tuple[str, str] | tuple[str, str, str] | None
    assert conform(["", "unsafe", "why"], problem) == ("", "unsafe", "why")
    for bad, shape in ((True, int), ([1, 2], problem), ({"a": 1}, dict[str, str])):
        with pytest.raises(MalformedPeerValue, match="rank 1 sent"):
            conform(bad, shape, "rank 1")


def _listening_while(cmd: list[str], port: int) -> tuple[set[str], subprocess.CompletedProcess]:
    """The local addresses that listened on `port` at any moment while `cmd` ran."""
    seen: set[str] = set()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env()) as proc:
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _listening(port)
            time.sleep(0.005)
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
    return seen, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_disttrain_checks_store_listens_on_the_loopback_endpoint_only():
    port = _free_port()
    cmd = [sys.executable, "-m", "disttrain.cli", "check", "--nproc", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "30"]
    seen, done = _listening_while(cmd, port)
    assert done.returncode == 0, done.stderr[-2000:]
    assert seen == {LOOPBACK}  # torch's own store would listen on every interface


# ---------------------------------------------------------------- disttrain etcd start


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


@pytest.mark.skipif(shutil.which("etcd") is None and not os.path.exists("/usr/bin/etcd"),
                    reason="etcd is not installed (scripts/test.sh installs etcd-server)")
def test_etcd_start_binds_loopback_and_stops_etcd_on_sigterm(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "disttrain.cli", "etcd", "start", "--port", str(port), "--data-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=worker_env())
    etcd: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        etcd += _children(proc.pid)
        assert len(etcd) == 1 and _listening(port) == {LOOPBACK}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _alive(etcd[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(etcd[0]) and not _listening(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in filter(_alive, etcd):  # what this test started, if the command left it
            os.kill(pid, signal.SIGKILL)
