"""Multi-node without a cluster: two "nodes" as Linux network namespaces joined by a
veth pair, each with its own address, an etcd server inside the first, and one
torchrun agent (`disttrain run --nnodes 1:2 --rdzv-backend etcd`) in each.

Scenario: train at world 2 across the namespaces, restart etcd under the running job
(training goes on), kill node B (its agent and every
process under it), the survivor continues at world 1, node B starts again, the job
is back at world 2 and finishes with exit 0, and every sample of the final timeline
was consumed exactly once. Where `ip netns add` is refused (no CAP_SYS_ADMIN, a
sandbox), the test skips and prints why; test_elastic.py runs the same scenario on
loopback with the c10d rendezvous. Traffic stays inside the two namespaces this test creates and deletes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter

import pytest
from elastic_helpers import audit_timeline, kill_node, metrics, start, trainer_cmd, wait_for

from disttrain.launch.etcd_server import EtcdServer

STEPS = 64
SLOW = "delay@step:ms=300"  # long enough for the scale events to land mid-run
SUBNET = "10.77.0"  # addresses of the test's own namespaces only; never routed elsewhere
ETCD_PORT = 2379  # a fresh namespace has every port free


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class TwoNodes:
    """Namespaces `a` and `b` with veths `va` (SUBNET.1) and `vb` (SUBNET.2), made by
    `up()` and removed (with every process still inside) by `down()`."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"dtnet{tag}a", "b": f"dtnet{tag}b"}
        self.veth = {"a": f"dtv{tag}a", "b": f"dtv{tag}b"}  # IFNAMSIZ: at most 15 characters
        self.addr = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}

    def up(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "add", ns)
        # Created straight inside the namespaces: the host's own interfaces are never touched.
        _ip("link", "add", self.veth["a"], "netns", self.ns["a"], "type", "veth",
            "peer", "name", self.veth["b"], "netns", self.ns["b"])
        for node, ns in self.ns.items():
            _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", self.veth[node])
            _ip("-n", ns, "link", "set", self.veth[node], "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def prefix(self, node: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns[node])

    def down(self) -> None:
        for ns in self.ns.values():
            # Processes left in a namespace would keep it alive: end them first (by pid).
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)  # also removes the veth pair


def _netns_or_skip() -> TwoNodes:
    nodes = TwoNodes()
    try:
        nodes.up()
    except FileNotFoundError:
        pytest.skip("the `ip` command (iproute2) is not installed; test_elastic.py covers "
                    "the same scenario on loopback")
    except subprocess.CalledProcessError as e:
        nodes.down()
        reason = f"`{' '.join(e.cmd)}` was refused: {e.stderr.strip() or e.returncode}"
        print(f"test_netns skipped: {reason}")
        pytest.skip(f"{reason}; test_elastic.py covers the same scenario on loopback")
    return nodes


def _end(nodes: TwoNodes, server: EtcdServer | None, agents: dict[str, subprocess.Popen]) -> None:
    """Kill every agent's tree, stop the etcd and remove the namespaces."""
    for proc in agents.values():
        kill_node(proc)
    if server is not None:
        server.stop()
    nodes.down()


@pytest.mark.timeout(400)
def test_two_namespace_nodes_scale_down_up_exactly_once(tmp_path):
    nodes = _netns_or_skip()
    agents: dict[str, subprocess.Popen] = {}
    server = None
    logs = [tmp_path / f"node-{n}.txt" for n in ("a", "b", "b2")]
    try:
        server = EtcdServer(host=nodes.addr["a"], port=ETCD_PORT, prefix=nodes.prefix("a"))
        server.start(timeout_s=20, log_path=tmp_path / "etcd.txt")

        def agent(node: str, log) -> subprocess.Popen:
            # --local-addr: the address other nodes reach this one at (the hostname may
            # resolve to one outside the namespace); GLOO_SOCKET_IFNAME: gloo binds the veth.
            flags = ("--nnodes", "1:2", "--nproc", "1", "--rdzv-backend", "etcd",
                     "--rdzv-endpoint", server.endpoint, "--rdzv-id", "netns-job",
                     "--max-restarts", "10", "--local-addr", nodes.addr[node])
            cmd = trainer_cmd(tmp_path, f"--train.steps={STEPS}", "--checkpoint.every=2", run_flags=flags)
            return start([*nodes.prefix(node), *cmd], log, DISTTRAIN_FAULT=SLOW,
                         GLOO_SOCKET_IFNAME=nodes.veth[node])

        def progressed(world: int, beyond: int) -> bool:
            return any(m["world_size"] == world and m["step"] > beyond for m in metrics(tmp_path))

        agents["a"] = agent("a", logs[0])
        agents["b"] = agent("b", logs[1])
        wait_for(lambda: progressed(2, 4), 150, "world 2 across the namespaces", logs)
        server.restart()  # etcd restarts under the running job (its state kept): training goes on
        mark = max(m["step"] for m in metrics(tmp_path))
        wait_for(lambda: progressed(2, mark + 2), 60, "progress after the etcd restart", logs)
        mark = max(m["step"] for m in metrics(tmp_path))
        t_kill = time.monotonic()
        kill_node(agents.pop("b"))
        wait_for(lambda: progressed(1, 0), 90, "world 1 after node b died", logs)
        t_down = time.monotonic() - t_kill
        mark = max(m["step"] for m in metrics(tmp_path) if m["world_size"] == 1)
        agents["b"] = agent("b", logs[2])
        t_start = time.monotonic()
        wait_for(lambda: progressed(2, mark), 90, "world 2 after node b rejoined", logs)
        print(f"scale-down {t_down:.1f} s, scale-up {time.monotonic() - t_start:.1f} s")
        for node, proc in agents.items():
            rc = proc.wait(timeout=max(5.0, 240 - (time.monotonic() - t_kill)))
            assert rc == 0, f"node {node} exited {rc}\n" + "\n".join(p.read_text()[-3000:] for p in logs
                                                                    if p.exists())
    finally:
        _end(nodes, server, agents)
    records = metrics(tmp_path)
    worlds = [m["world_size"] for m in records]
    assert 1 in worlds and worlds[-1] == 2
    assert records[-1]["step"] == STEPS and mark < STEPS
    timeline = audit_timeline(tmp_path)
    assert sorted(timeline) == list(range(1, STEPS + 1))
    counts = Counter(i for step in timeline.values() for i in step)
    assert len(counts) == STEPS * 8 and set(counts.values()) == {1}  # 8 samples a step, each once


@pytest.mark.timeout(300)
def test_a_lost_namespace_node_is_found_by_its_probe_and_the_other_shrinks_in_memory(tmp_path):
    """Fast recovery across the two namespaces (`--nnodes 2`, etcd in node a's namespace):
    kill -9 of the whole tree of the node that holds rank 0. Its supervisor's address
    (on its veth) is refused by its namespace's kernel, so the survivor settles the
    generation without the lease, hosts the next generation's store on its own veth
    address, and goes on at world 1 in memory: no torchrun restart, exit 0."""
    nodes = _netns_or_skip()
    agents: dict[str, subprocess.Popen] = {}
    server = None
    logs = {n: tmp_path / f"node-{n}.txt" for n in ("a", "b")}
    try:
        server = EtcdServer(host=nodes.addr["a"], port=ETCD_PORT, prefix=nodes.prefix("a"))
        server.start(timeout_s=20, log_path=tmp_path / "etcd.txt")
        for node in ("a", "b"):
            flags = ("--nnodes", "2", "--nproc", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint,
                     "--rdzv-id", "netns-fast", "--local-addr", nodes.addr[node])
            # A lease far longer than a probe takes, so that a loaded machine's slow beats
            # cannot decide first: only the probe settles this generation within 10 s.
            cmd = trainer_cmd(tmp_path, "--train.steps=24", "--checkpoint.every=4", "--elastic.fast_recovery=true",
                              "--elastic.node_lease_s=10", run_flags=flags)
            agents[node] = start([*nodes.prefix(node), *cmd], logs[node], DISTTRAIN_FAULT="delay@step:ms=150",
                                 GLOO_SOCKET_IFNAME=nodes.veth[node], DISTTRAIN_JOB_SECRET="9c" * 32)
        wait_for(lambda: any(m["step"] >= 14 for m in metrics(tmp_path)), 150, "step 14 across the namespaces",
                 list(logs.values()))
        lost = next(n for n, log in logs.items() if "rank 0 (local rank 0) is pid" in log.read_text())
        survivor = "b" if lost == "a" else "a"
        kill_node(agents.pop(lost))
        rc = agents[survivor].wait(timeout=150)
        text = logs[survivor].read_text()
        assert rc == 0, text[-4000:]
    finally:
        _end(nodes, server, agents)
    assert "rank(s) [0] lost with their supervisors (their node refused a connection to them" in text, text[-4000:]
    assert "will restart worker group" not in text
    records = metrics(tmp_path)
    assert records[-1]["step"] == 24 and records[-1]["world_size"] == 1
