"""The doctor's data-flow core (issue #26): each cause of a false finding and each kind
of bug the doctor missed on projects it was not tuned on, as a test.

Every test here failed on the doctor before the data-flow core (rank-derived values,
one-rank functions across files, rank-aware print/logging, collectives reached through
project functions, the single-process and launcher-parent paths) and the behavioural and
dt.Job rules. Multi-file programs are written to tmp_path and checked in one run, the
way `disttrain doctor train.py utils/` checks them.
"""

from __future__ import annotations

import textwrap

from doctor_rules.rule_check import PRE, found, found_in  # noqa: F401  (shared helpers; found_in re-exported)
from doctor_rules.rule_check import RANK_ZERO_HELPERS as MISC  # misc.py: a set-up helper, a print override

from disttrain.doctor.analyzer import analyze_source

# ----- the causes of false findings ----------------------------------------------------

MAIN = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
import misc
from engine import train_one_epoch

def main(args):
    misc.start_from_env(args)
    print("job dir", args.output_dir)
    model = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=[args.device_index])
    train_one_epoch(model, args)
"""

ENGINE = """
import torch

def train_one_epoch(model, args):
    for step in range(10):
        print("step", step)
"""


def test_a_print_override_installed_by_a_helper_in_another_file_makes_print_rank_aware(tmp_path):
    # cause 1: a helper replaces builtins.print (quiet_unless here), called from an
    # init function in another file (MAE, DeiT, DETR, DINO ...)
    got = found_in(tmp_path, {"misc.py": MISC, "main.py": MAIN, "engine.py": ENGINE}, "unguarded-log")
    assert got == []


def test_a_print_override_inline_in_the_same_function():
    src = PRE + textwrap.dedent("""
    import builtins
    def main():
        if rank != 0:
            builtins.print = lambda *a, **k: None
        print("loss", 1.0)
    """)
    assert found(src, "unguarded-log") == []


def test_an_unrelated_script_lends_no_print_override(tmp_path):
    other = PRE + "print('every rank')\n"
    got = found_in(tmp_path, {"misc.py": MISC, "other.py": other}, "unguarded-log")
    assert [g[0] for g in got] == ["other.py"]


def test_a_flag_computed_from_the_rank_is_a_guard():
    # cause 2 (open_clip): a flag set from other options and a rank test
    src = PRE + textwrap.dedent("""
    def first_rank(opts):
        return opts.rank == 0
    def main(opts):
        opts.writes = bool(opts.out) and opts.out != "-" and first_rank(opts)
        if opts.writes:
            torch.save({}, "ckpt.pt")
    main(None)
    """)
    assert found(src, "unguarded-save") == []


def test_an_object_made_only_on_rank_0_guards_what_tests_it():
    src = PRE + textwrap.dedent("""
    from torch.utils.tensorboard import SummaryWriter
    writer = None
    if rank == 0:
        writer = SummaryWriter("runs")
    if writer is not None:
        torch.save({}, "ckpt.pt")
    """)
    assert found(src, "unguarded-save") == []


def test_a_helper_called_only_under_a_guard_in_another_file(tmp_path):
    helper = """
    import os, torch
    WORLD_SIZE = int(os.environ["WORLD_SIZE"])
    def save_model(model, path):
        torch.save(model.state_dict(), path + ".tmp")
    """
    main = PRE + textwrap.dedent("""
    from helpers import save_model
    model = torch.nn.Linear(2, 2).cuda()
    if rank == 0:
        save_model(model, "m.pt")
    """)
    got = found_in(tmp_path, {"helpers.py": helper, "main.py": main}, "unguarded-save")
    assert got == []


def test_a_scaler_in_a_helper_file_and_the_ddp_wrap_in_the_entry_script(tmp_path):
    # cause 3: under DDP the gradients are all-reduced before unscale_: the plain scaler is right
    helper = """
    import os, torch
    WORLD_SIZE = int(os.environ["WORLD_SIZE"])
    class NativeScaler:
        def __init__(self):
            self._scaler = torch.cuda.amp.GradScaler()
    """
    main = PRE + textwrap.dedent("""
    from helpers import NativeScaler
    model = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=[local_rank])
    scaler = NativeScaler()
    """)
    assert found_in(tmp_path, {"helpers.py": helper, "main.py": main}, "gradscaler-unsynced") == []


def test_a_scaler_with_no_wrap_in_view_is_silent_or_a_warning_never_an_error():
    # the model is usually wrapped out of view: say nothing; a hand-written gradient
    # all-reduce shows there is no DDP: a warning that says what the doctor could not see
    helper = "import torch, os\nRANK = os.environ['RANK']\nscaler = torch.cuda.amp.GradScaler()\n"
    assert found(helper, "gradscaler-unsynced") == []
    manual = helper + "import torch.distributed as dist\nfor p in model.parameters():\n    dist.all_reduce(p.grad)\n"
    assert found(manual, "gradscaler-unsynced") == [("gradscaler-unsynced", 3, "warning")]


def test_set_device_in_another_file_s_init_helper(tmp_path):
    # cause 4: missing-set-device was an error although misc.start_from_env binds it
    got = found_in(tmp_path, {"misc.py": MISC, "main.py": MAIN, "engine.py": ENGINE}, "missing-set-device")
    assert got == []


def test_an_init_helper_out_of_view_makes_missing_set_device_a_warning():
    src = textwrap.dedent("""
    import os, torch
    import utils
    utils.init_distributed_mode(args)
    local_rank = int(os.environ["LOCAL_RANK"])
    x = torch.zeros(2).cuda()
    """)
    assert found(src, "missing-set-device") == [("missing-set-device", 6, "warning")]


def test_the_else_branch_of_if_distributed_is_one_process():
    # cause 5: the single-process path does not run on every rank
    src = PRE + textwrap.dedent("""
    def main(args):
        model = torch.nn.Linear(2, 2).cuda()
        if args.distributed:
            model = DDP(model, device_ids=[local_rank])
        else:
            print("single process")
            torch.save(model.state_dict(), "init.pt.tmp")
    main(None)
    """)
    assert found(src, "unguarded-log") == [] and found(src, "unguarded-save") == []


def test_a_guard_written_as_a_conditional_expression():
    src = PRE + "from torch.utils.tensorboard import SummaryWriter\n" \
                "writer = SummaryWriter('runs') if rank == 0 else None\n"
    assert found(src, "unguarded-log") == []


def test_a_logger_made_rank_aware_by_a_library_set_up_out_of_view():
    src = PRE + textwrap.dedent("""
    import logging
    from detectron2.utils.logger import setup_logger
    setup_logger(output_dir, distributed_rank=rank)
    logger = logging.getLogger(__name__)
    logger.info("iteration done")
    """)
    assert found(src, "unguarded-log") == []


def test_a_print_in_the_launcher_s_parent_before_it_spawns_workers():
    src = textwrap.dedent("""
    import datetime, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    def worker(gpu, args):
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", init_method="env://", rank=gpu, world_size=2,
                                timeout=datetime.timedelta(minutes=5))
    def main():
        args = None
        print("spawning 2 workers")
        mp.spawn(worker, nprocs=2, args=(args,))
    if __name__ == "__main__":
        print("starting")
        main()
    """)
    assert found(src, "unguarded-log") == []


def test_mp_spawn_does_not_claim_no_multi_node_for_a_launcher_with_a_node_rank():
    src = textwrap.dedent("""
    import torch.multiprocessing as mp
    def worker(gpu, args):
        rank = args.node_rank * args.gpus + gpu
    mp.spawn(worker, nprocs=2, args=(None,))
    """)
    fs = [f for f in analyze_source("s.py", src, advice=True) if f.rule == "mp-spawn"]
    assert fs and "no multi-node" not in fs[0].message


# ----- error only when sure --------------------------------------------------------------

def test_an_unguarded_save_in_a_function_nobody_in_view_calls_is_a_warning():
    src = PRE + "def save_snapshot(model):\n    torch.save(model.state_dict(), 'snap.pt')\n"
    assert found(src, "unguarded-save") == [("unguarded-save", 12, "warning")]
    called = src + "save_snapshot(None)\n"
    assert found(called, "unguarded-save") == [("unguarded-save", 12, "error")]


def test_a_ddp_path_that_never_binds_a_device_beside_one_that_does():
    # moco-v3 / simsiam: `if args.gpu is not None: set_device ... else: model.cuda(); DDP(model)`
    src = PRE.replace("torch.cuda.set_device(local_rank)\n", "") + textwrap.dedent("""
    def main_worker(gpu, args, model):
        if args.gpu is not None:
            torch.cuda.set_device(args.gpu)
            model.cuda(args.gpu)
            model = DDP(model, device_ids=[args.gpu])
        else:
            model.cuda()
            model = DDP(model)
    """)
    assert ("missing-set-device", 17, "warning") in found(src)


def test_set_device_from_a_local_rank_argument_torchrun_never_passes():
    src = textwrap.dedent("""
    import argparse, datetime, torch
    import torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", default=0, type=int)
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    """)
    assert found(src, "guard-true-on-every-rank") == [("guard-true-on-every-rank", 7, "warning")]
