"""Rank values followed by what they hold, not by their names.

Each test is a small script written for this suite; a comment may name the public
project whose review showed the case (a fact); the code is ours.
"""

from __future__ import annotations

from rule_check import found_in

# OpenPCDet: the launcher's set-up returns (gpus, dist.get_rank()), picked by name with
# getattr, and the caller stores it in a field called LOCAL_RANK
SET_UP = """
import datetime, os
import torch
import torch.distributed as dist
def init_dist_slurm(port, local_rank):
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    return torch.cuda.device_count(), rank
def init_dist_pytorch(port, local_rank):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    return torch.cuda.device_count(), rank
"""

ENTRY = """
import os
import torch
import common_utils
def main(cfg, args, model):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gpus, cfg.LOCAL_RANK = getattr(common_utils, "init_dist_%s" % args.launcher)(args.port, 0)
    if cfg.LOCAL_RANK == 0:
        torch.save(model.state_dict(), "model.pt.tmp")
main(None, None, None)
"""


def test_a_field_named_local_rank_that_holds_the_global_rank_guards_one_process(tmp_path):
    got = found_in(tmp_path / "a", {"common_utils.py": SET_UP, "train.py": ENTRY}, "unguarded-save")
    assert got == []
    # the look-alike: the set-up hands back the node's local rank, and the guard is local
    local = SET_UP.replace("rank = dist.get_rank()", 'rank = int(os.environ["LOCAL_RANK"])')
    got = found_in(tmp_path / "b", {"common_utils.py": local, "train.py": ENTRY}, "unguarded-save")
    assert got == [("train.py", "unguarded-save", 9, "warning")]
