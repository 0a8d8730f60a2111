"""Round 2 of issue 26: each cause of a false finding the first held-back review found
(tests/doctor_corpus/projects, BENCHMARKS.md), fixed before the fresh held-back projects
were added."""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_source
from test_doctor_dataflow import PRE, found  # noqa: F401  (shared helpers)


def test_a_device_named_with_its_index_before_set_device_is_no_cuda_use():
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    x = torch.zeros(2).cuda()
    """)
    assert found(src, "missing-set-device") == []


def test_a_main_process_decorator_guards_the_save():
    src = PRE + "from utils import main_process\n@main_process\ndef save(m, p):\n    torch.save(m, p)\nsave(1, 'c.pt')\n"
    assert found(src, "unguarded-save") == []


def test_a_per_rank_file_name_held_in_a_variable():
    src = PRE + textwrap.dedent("""
    def dump(queue, args):
        queue_path = os.path.join(args.dump_path, "queue" + str(args.rank) + ".pth")
        torch.save({"queue": queue}, queue_path)
    dump(None, None)
    """)
    assert found(src, "unguarded-save") == []


def test_the_spawn_index_of_a_multi_node_launcher_is_a_local_rank():
    src = textwrap.dedent("""
    import datetime, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    def main_worker(gpu, ngpus_per_node, args):
        args.gpu = gpu
        args.rank = args.rank * ngpus_per_node + gpu
        torch.cuda.set_device(args.gpu)
        dist.init_process_group("nccl", rank=args.rank, timeout=datetime.timedelta(minutes=5))
        if args.gpu == 0:
            torch.save({}, "final.pth")
    mp.spawn(main_worker, nprocs=8, args=(8, None))
    """)
    assert found(src, "unguarded-save") == [("unguarded-save", 11, "warning")]


def test_a_helper_called_from_both_branches_of_a_rank_test_runs_on_every_rank():
    src = PRE + textwrap.dedent("""
    def bcast(t, src=0):
        dist.broadcast(t, src)
        return t
    def broadcast_object(obj, t):
        if dist.get_rank() == 0:
            t = bcast(t)
        else:
            t = bcast(t)
        return t
    """)
    assert found(src, "collective-under-rank-guard") == []


def test_a_sampler_appended_to_a_list_hides_no_set_epoch():
    src = PRE + textwrap.dedent("""
    from torch.utils.data import DistributedSampler
    samplers = []
    for ds in datasets:
        sampler = DistributedSampler(ds)
        samplers.append(sampler)
    for epoch in range(3):
        pass
    """)
    fs = [f for f in analyze_source("s.py", src) if f.rule == "sampler-without-set-epoch"]
    assert fs and not any("append" in f.message for f in fs)  # a list is no callee that hides it


def test_the_model_called_before_its_ddp_wrap_is_no_ddp_forward():
    src = PRE + "model = nn.Linear(2, 2).cuda()\nif rank == 0:\n    model(x)\nmodel = DDP(model, device_ids=[local_rank])\n"
    assert found(src, "collective-under-rank-guard") == []


def test_logging_configured_by_a_set_up_out_of_view_is_not_judged():
    src = PRE + "import logging\nfrom lavis.common.logger import setup_logger\nsetup_logger()\nlogging.info('start training')\n"
    assert found(src, "unguarded-log") == []
