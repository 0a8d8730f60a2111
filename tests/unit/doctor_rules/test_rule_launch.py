"""init-without-timeout, init-rank-is-local-rank, hardcoded-master-port, mp-spawn: how
the process group starts.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import found, found_in, rules

from disttrain.doctor.analyzer import analyze_paths

# ml-4m: `timedelta(4800)` meant as seconds is 4800 days; gpt-neox: DeepSpeed's init with
# no timeout starts the same process group
DAYS_OR_NO_TIMEOUT = """
import datetime, deepspeed, torch
torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(3600))
deepspeed.init_distributed(dist_backend="nccl")
torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(seconds=3600))
deepspeed.init_distributed(dist_backend="nccl", timeout=datetime.timedelta(minutes=10))
"""

# LatentSync: init_process_group(**kwargs), and the one caller passes no timeout
KWARGS_INIT = """
import os, torch, torch.distributed as dist
def start(backend="nccl", **extra):
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend, **extra)
def main():
    start()
main()
"""

# jukebox: its own adapter's init_process_group takes no timeout; the torch call inside is judged
OWN_INIT_WRAPPER = """
import torch.distributed as dist
def init_process_group(backend, url):
    return dist.init_process_group(backend, url)
"""

WRAPPER_CALLER = """
import os, torch
import adapter as dist
def begin():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", "env://")
begin()
"""

# KAIR: **kwargs forwarded twice before init_process_group, and no caller passes a timeout
KWARGS_TWICE = """
import os, torch, torch.distributed as dist
def start(how, backend="nccl", **extra):
    if how == "torchrun":
        _start_torchrun(backend, **extra)
def _start_torchrun(backend, **extra):
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend, **extra)
start("torchrun")
"""


def test_the_rank_a_script_joins_the_group_with_is_its_global_rank():
    # cleanrl: init_process_group(rank=local_rank): local rank 0 is the process group's rank 0
    src = textwrap.dedent("""
    import os, datetime, torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", rank=local_rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))
    if local_rank == 0:
        print("steps per second: 100")
    """)
    assert found(src, "unguarded-log") == []
    # ... and on several nodes two processes claim each rank: the rank is a local one
    assert found(src, "init-rank-is-local-rank") == [("init-rank-is-local-rank", 5, "warning")]
    global_rank = src.replace('rank=local_rank', 'rank=int(os.environ["RANK"])')
    assert found(global_rank, "init-rank-is-local-rank") == []


def test_a_node_rank_read_in_another_file_of_the_program_makes_mp_spawn_multi_node(tmp_path):
    # mmf: run.py spawns; utils/distributed.py derives the node's start rank from SLURM
    files = {
        "run.py": "import torch\nfrom distributed import node_start\n"
                  "def run(cfg):\n    node_start(cfg)\n"
                  "    torch.multiprocessing.spawn(fn=main, args=(cfg,), nprocs=8)\n",
        "distributed.py": "import os\ndef node_start(cfg):\n"
                          "    node_id = int(os.environ.get('SLURM_NODEID'))\n"
                          "    cfg.rank = node_id * 8\n"}
    assert [f for f in found_in(tmp_path, files) if f[1] == "mp-spawn"] == []  # advice: not a defect
    _, fs = analyze_paths([str(tmp_path)], advice=True)
    [f] = [x for x in fs if x.rule == "mp-spawn"]
    assert f.severity == "advice" and "no multi-node" not in f.message


def test_a_timeout_of_days_or_none_given_to_deepspeed_is_reported():
    assert [f[:2] for f in found(DAYS_OR_NO_TIMEOUT, "init-without-timeout")] == [
        ("init-without-timeout", 3), ("init-without-timeout", 4)]


def test_a_timeout_passed_through_kwargs_by_no_caller_is_none():
    assert [f[1] for f in found(KWARGS_INIT, "init-without-timeout")] == [5]
    passed = KWARGS_INIT.replace("    start()", "    start(timeout=t)")
    assert found(passed, "init-without-timeout") == []


def test_a_call_of_the_projects_own_init_wrapper_is_judged_at_its_torch_call(tmp_path):
    got = found_in(tmp_path, {"adapter.py": OWN_INIT_WRAPPER, "train.py": WRAPPER_CALLER}, "init-without-timeout")
    assert [(f[0], f[2]) for f in got] == [("adapter.py", 4)]


def test_a_timeout_forwarded_through_two_helpers_by_no_caller_is_none():
    assert [f[1] for f in found(KWARGS_TWICE, "init-without-timeout")] == [8]
    passed = KWARGS_TWICE.replace('start("torchrun")', 'start("torchrun", timeout=t)')
    assert found(passed, "init-without-timeout") == []


def test_a_hard_coded_port_in_a_dist_url_default():
    src = textwrap.dedent("""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-url", default="tcp://10.1.2.3:29511")
    """)
    assert found(src, "hardcoded-master-port") == [("hardcoded-master-port", 4, "warning")]


def test_fake_backend_needs_no_timeout():
    for backend in ("fake", "local_tensor"):
        src = f"import torch\ntorch.distributed.init_process_group({backend!r}, rank=0, store=store)\n"
        assert "init-without-timeout" not in rules(src)
    assert "init-without-timeout" in rules("import torch\ntorch.distributed.init_process_group('nccl')\n")
