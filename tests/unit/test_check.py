"""`disttrain check` without a second node: its flags, the rules that compare nodes, and
(in-process, no process group). Runs of real nodes are in test_check_netns.py."""

from __future__ import annotations

import pytest

from disttrain.errors import UserError
from disttrain.launch.check_command import parse
from disttrain.launch.check_facts import Limits, NodeFacts, problems


def _node(addr: str, **kw) -> NodeFacts:
    base = dict(host="h", addr=addr, python="3.11.7", torch="2.13.0", disttrain="0.2.0",
                devices=8, nproc=8)
    return NodeFacts(**{**base, **kw})


def test_parse_takes_the_flags_of_disttrain_run(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[train]\nout_dir = "{tmp_path / "out"}"\n')
    args = parse(["--nnodes", "1:4", "--nproc-per-node", "8", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                  "head:2379", "--rdzv-id", "j", "--max-restarts", "3", "-m", "disttrain.train", str(cfg)])
    assert (args.nnodes, args.nproc, args.backend, args.host, args.port) == (4, 8, "etcd-v2", "head", 2379)
    assert args.run_id == "j-check" and args.timeout_s == 10.0  # never the job's own rendezvous state
    assert args.ckpt_dir == str(tmp_path / "out" / "checkpoints")  # from the trainer's config
    args = parse(["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head",
                  "--checkpoint-dir", "/ck", "train.py", "--lr", "1"])
    assert (args.port, args.ckpt_dir) == (29400, "/ck")


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--nproc", "1"], "static rendezvous: give --master-addr"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "zmq", "--rdzv-endpoint", "h:1"], "'zmq' is not"),
    (["--nnodes", "0", "--nproc", "1"], "--nnodes is '0'"),
    (["--nproc", "1", "--timeout", "0"], "--timeout is 0"),
    (["--nproc", "1", "--timeout", "soon"], "argument --timeout"),
    (["--nproc", "1", "--checkpoint-dri", "/ck"], "unknown flag --checkpoint-dri"),
])
def test_check_flag_mistakes_name_the_flag(argv, message):
    with pytest.raises(UserError, match=message):
        parse(argv)


def test_problems_name_the_odd_node_for_each_rule():
    limits = Limits(min_free_gib=1.0, max_clock_skew_s=2.0)
    healthy = [_node("10.0.0.1"), _node("10.0.0.2"), _node("10.0.0.3")]
    assert problems(healthy, limits) == []
    nodes = [_node("10.0.0.1"), _node("10.0.0.2", torch="2.12.0", devices=4, clock_offset_s=3.5),
             _node("10.0.0.3", ckpt_dir="/ck", ckpt_error="not writable (Read-only file system)"),
             _node("10.0.0.4", ckpt_dir="/ck", ckpt_free_gib=0.5)]
    found = problems(nodes, limits)
    assert all(p.startswith("node ") for p in found)
    on = {p.split(":")[0]: p for p in found}
    assert "torch 2.12.0 differs from 2.13.0" in " ".join(p for p in found if p.startswith("node 10.0.0.2"))
    assert any("sees 4 GPU(s)" in p for p in found) and any("8 is more than its 4" in p for p in found)
    assert any("+3.50 s off" in p for p in found)
    assert "Read-only" in on["node 10.0.0.3 (h)"] and "0.50 GiB free" in on["node 10.0.0.4 (h)"]
    assert not any(p.startswith("node 10.0.0.1") for p in found)  # the majority is never blamed
