"""`disttrain check` on two network-namespace nodes (the set-up of test_netns.py): a
healthy pair passes, a node whose link is cut is named by the default 10 s timeout
instead of a hang, and a node that runs another disttrain (a real copy of the package
with another version, first on its PYTHONPATH) is named. Skips where `ip netns` is
refused, as test_netns.py does."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, worker_env
from test_netns import _ip, _netns_or_skip

PORT = 29400
SLOW_START = ("--timeout", "45")
"""For the checks that must pass: on a loaded machine one node's interpreter can start
more than the default 10 s after the other's (test_check.py pins the default)."""


def _check(nodes, node: str, tmp: Path, first_on_path: str = "", *extra: str) -> subprocess.Popen:
    """`disttrain check` for a 2-node c10d job whose store is on node a."""
    cmd = [*nodes.prefix(node), sys.executable, "-m", "disttrain.cli", "check", "--nnodes", "2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"{nodes.addr['a']}:{PORT}", "--rdzv-id", "job", "--local-addr", nodes.addr[node],
           "--checkpoint-dir", str(tmp / "ckpt"), *extra]
    env = worker_env(GLOO_SOCKET_IFNAME=nodes.veth[node])
    if first_on_path:
        env["PYTHONPATH"] = first_on_path + os.pathsep + env["PYTHONPATH"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _both(nodes, tmp: Path, path_b: str = "", *extra: str, timeout: float = 60) -> dict[str, tuple[int, str]]:
    procs = {"a": _check(nodes, "a", tmp, "", *extra), "b": _check(nodes, "b", tmp, path_b, *extra)}
    out = {}
    for node, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            pytest.fail(f"disttrain check on node {node} hung past {timeout:.0f} s:\n{text[-3000:]}")
        out[node] = (proc.returncode, text)
    return out


@pytest.fixture
def nodes():
    pair = _netns_or_skip()
    try:
        yield pair
    finally:
        pair.down()


@pytest.mark.timeout(90)
def test_check_passes_on_two_healthy_nodes(nodes, tmp_path):
    out = _both(nodes, tmp_path, "", *SLOW_START)
    for node, (rc, text) in out.items():
        assert rc == 0, f"node {node}:\n{text}"
        assert "2 node(s) healthy" in text and "all-reduce gloo" in text
        assert nodes.addr["a"] in text and nodes.addr["b"] in text  # one table row per node


@pytest.mark.timeout(90)
def test_check_names_the_node_whose_link_is_cut(nodes, tmp_path):
    _ip("-n", nodes.ns["b"], "link", "set", nodes.veth["b"], "down")
    # 5 s instead of the default 10 (test_check.py pins the default): the same path, sooner.
    out = _both(nodes, tmp_path, "", "--timeout", "5", timeout=45)
    rc_b, text_b = out["b"]
    assert rc_b == 2, text_b
    assert (
        f"node {nodes.addr['b']} ({socket.gethostname()}): cannot reach the rendezvous endpoint "
        f"{nodes.addr['a']}:{PORT} within 5 s"
    ) in text_b
    rc_a, text_a = out["a"]
    assert rc_a == 2 and "not all 2 nodes joined the rendezvous" in text_a, text_a
    assert "Traceback" not in text_a + text_b


@pytest.mark.timeout(90)
def test_check_names_the_node_with_another_disttrain(nodes, tmp_path):
    """Node b runs a real copy of the package with another version, and its checkpoint
    directory cannot be created: both are named, on both nodes, after the table."""
    fake = tmp_path / "other"
    shutil.copytree(ROOT / "src" / "disttrain", fake / "disttrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "disttrain" / "version.py").write_text('__version__ = "9.9.9"\n')
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    procs = {"a": _check(nodes, "a", tmp_path, "", *SLOW_START),
             "b": _check(nodes, "b", tmp_path, str(fake), "--checkpoint-dir", str(blocker / "ckpt"), *SLOW_START)}
    for node, proc in procs.items():
        text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, f"node {node}:\n{text}"
        assert f"node {nodes.addr['b']} (" in text and "disttrain 9.9.9 differs from 0.2.0" in text, text
        assert "checkpoint directory" in text and "not writable" in text, text
        assert "Traceback" not in text and "problem(s)" in text  # the table, then the lines
