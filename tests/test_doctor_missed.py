"""Issue 26: each kind of bug the doctor missed on projects it was not tuned on, as a test
that failed before the behavioural rules (rules_behaviour.py, the collective paths of
rules_sync.py, the launch paths of rules_device.py)."""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_source  # noqa: F401
from test_doctor_dataflow import MISC, PRE, found, found_in  # noqa: F401  (shared helpers)


def test_evaluation_of_the_ddp_model_on_rank_0_only():
    src = PRE + textwrap.dedent("""
    model = DDP(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).cuda(), device_ids=[local_rank])
    def evaluate(net, loader):
        with torch.no_grad():
            for x in loader:
                net(x)
    for epoch in range(3):
        if rank == 0:
            evaluate(model, val_loader)
    """)
    assert ("collective-under-rank-guard", 19, "warning") in found(src)


def test_the_ddp_model_called_directly_under_a_guard():
    src = PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\nif rank == 0:\n    model(x)\n"
    assert found(src, "collective-under-rank-guard") == [("collective-under-rank-guard", 13, "warning")]


def test_an_early_return_on_rank_0_before_a_collective():
    src = PRE + textwrap.dedent("""
    def finish(args, t):
        if rank == 0:
            print("done")
            return
        dist.all_reduce(t)
    """)
    assert found(src, "collective-under-rank-guard") == [("collective-under-rank-guard", 16, "error")]


def test_a_broadcast_based_loader_in_another_file_called_on_rank_0_only(tmp_path):
    data = """
    import torch.distributed as dist
    def load_data(path):
        objs = [None]
        dist.broadcast_object_list(objs, src=0)
        return objs[0]
    """
    main = PRE + "from data import load_data\nif rank == 0:\n    train = load_data('train.bin')\n"
    got = found_in(tmp_path, {"data.py": data, "main.py": main}, "collective-under-rank-guard")
    assert got == [("data.py", "collective-under-rank-guard", 5, "error")]


def test_a_rank_local_exit_on_a_non_finite_loss():
    src = PRE + textwrap.dedent("""
    def train(model, loader):
        for x in loader:
            loss = model(x).mean()
            loss_value = loss.item()
            if not math.isfinite(loss_value):
                print("Loss is {}, stopping training".format(loss_value))
                sys.exit(1)
            loss.backward()
    """)
    assert found(src, "rank-local-exit") == [("rank-local-exit", 18, "warning")]
    reduced = src.replace("        loss_value = loss.item()\n",
                          "        dist.all_reduce(loss)\n        loss_value = loss.item()\n")
    assert reduced != src
    assert found(reduced, "rank-local-exit") == []


def test_a_non_atomic_save_through_a_save_on_master_wrapper(tmp_path):
    main = PRE + textwrap.dedent("""
    import misc
    def main(args, model):
        misc.save_on_master({"model": model.state_dict()}, "checkpoint.pth")
    """)
    got = found_in(tmp_path, {"misc.py": MISC, "main.py": main}, "non-atomic-save")
    assert got == [("main.py", "non-atomic-save", 14, "warning")]


def test_a_barrier_before_set_device():
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    def init(args):
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
        dist.barrier()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    """)
    assert found(src, "collective-before-set-device") == [("collective-before-set-device", 6, "warning")]


def test_an_env_launch_path_that_never_binds_a_device():
    # one set_device elsewhere in the file (the SLURM path) used to silence the rule
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    def init_distributed(args):
        if "SLURM_PROCID" in os.environ:
            args.rank = int(os.environ["SLURM_PROCID"])
            args.gpu = args.rank % torch.cuda.device_count()
            torch.cuda.set_device(args.gpu)
        elif "RANK" in os.environ:
            args.rank = int(os.environ["RANK"])
            args.gpu = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    x = torch.zeros(2).cuda()
    """)
    assert ("missing-set-device", 10, "warning") in found(src)


def test_accumulation_without_no_sync_with_the_loop_and_the_wrap_in_different_files(tmp_path):
    engine = """
    def train_one_epoch(model, optimizer, loader, accum_iter):
        for i, x in enumerate(loader):
            loss = model(x).mean() / accum_iter
            loss.backward()
            if (i + 1) % accum_iter == 0:
                optimizer.step()
                optimizer.zero_grad()
    """
    main = PRE + textwrap.dedent("""
    from engine import train_one_epoch
    model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])
    """)
    got = found_in(tmp_path, {"engine.py": engine, "main.py": main}, "accumulation-without-no-sync")
    assert got == [("engine.py", "accumulation-without-no-sync", 7, "warning")]


def test_a_save_guard_true_on_every_rank_under_torchrun():
    src = textwrap.dedent("""
    import argparse, datetime, torch
    import torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    if args.local_rank == 0:
        torch.save({}, "ckpt.pt.tmp")
    """)
    assert found(src, "guard-true-on-every-rank") == [("guard-true-on-every-rank", 7, "warning"),
                                                      ("guard-true-on-every-rank", 10, "warning")]
    env = src.replace("args = parser.parse_args()\n",
                      "args = parser.parse_args()\nargs.local_rank = int(os.environ['LOCAL_RANK'])\n")
    assert found(env, "guard-true-on-every-rank") == []


def test_a_hard_coded_port_in_a_dist_url_default():
    src = textwrap.dedent("""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-url", default="tcp://224.66.41.62:23456", type=str)
    """)
    assert found(src, "hardcoded-master-port") == [("hardcoded-master-port", 4, "warning")]


def test_an_ema_copied_from_a_per_rank_random_init_before_ddp_s_broadcast():
    src = PRE + textwrap.dedent("""
    from timm.utils import ModelEma
    seed = 42 + dist.get_rank()
    torch.manual_seed(seed)
    model = nn.Linear(2, 2).cuda()
    model_ema = ModelEma(model, decay=0.9999)
    model = DDP(model, device_ids=[local_rank])
    """)
    assert found(src, "ema-before-broadcast") == [("ema-before-broadcast", 16, "warning")]
    same_seed = src.replace("seed = 42 + dist.get_rank()", "seed = 42")
    assert found(same_seed, "ema-before-broadcast") == []


def test_a_full_fsdp_state_dict_gathered_onto_every_gpu():
    src = PRE + textwrap.dedent("""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig
    model = FSDP(nn.Linear(2, 2).cuda())
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt.tmp")
    """)
    assert found(src, "full-state-dict-on-every-gpu") == [("full-state-dict-on-every-gpu", 14, "warning")]
    ok = src.replace("FullStateDictConfig(rank0_only=True)", "FullStateDictConfig(offload_to_cpu=True, rank0_only=True)")
    assert found(ok, "full-state-dict-on-every-gpu") == []


def test_an_fsdp_state_dict_under_a_rank_guard_is_a_collective():
    src = PRE + textwrap.dedent("""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = FSDP(nn.Linear(2, 2).cuda())
    if rank == 0:
        sd = model.state_dict()
    """)
    assert found(src, "collective-under-rank-guard") == [("collective-under-rank-guard", 15, "error")]


def test_an_mpi_broadcast_helper_called_on_one_rank(tmp_path):
    dist_util = """
    from mpi4py import MPI
    def load_state_dict(path):
        data = None
        if MPI.COMM_WORLD.Get_rank() == 0:
            data = open(path, "rb").read()
        return MPI.COMM_WORLD.bcast(data)
    """
    main = PRE + "import dist_util\nif rank == 0:\n    sd = dist_util.load_state_dict('m.pt')\n"
    got = found_in(tmp_path, {"dist_util.py": dist_util, "main.py": main}, "collective-under-rank-guard")
    assert got == [("dist_util.py", "collective-under-rank-guard", 7, "error")]


