"""data-parallel, data-parallel-in-ddp, optimizer-before-wrap, find-unused-parameters,
ddp-state-dict-prefix: wrapping the model.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from rule_check import PRE, found, found_in, rules

# DPR: the helper wraps in DataParallel when n_gpu > 1 and in DDP when local_rank != -1;
# the set-up in another file sets n_gpu = 1 beside each init_process_group
GPU_COUNT_SETUP = """
import torch
def pick_devices(cfg):
    if cfg.local_rank < 0:
        cfg.n_gpu = torch.cuda.device_count()
    else:
        torch.cuda.set_device(cfg.local_rank)
        torch.distributed.init_process_group("nccl")
        cfg.n_gpu = 1
    return cfg
"""

GPU_COUNT_ENTRY = """
from options import pick_devices
from model_utils import wrap_for_devices
def main(cfg, net):
    cfg = pick_devices(cfg)
    net = wrap_for_devices(net, cfg.device, cfg.n_gpu, cfg.local_rank)
main(None, None)
"""

GPU_COUNT_WRAP = """
import torch
def wrap_for_devices(net, device, n_gpu=1, local_rank=-1):
    net.to(device)
    if n_gpu > 1:
        net = torch.nn.DataParallel(net)
    if local_rank >= 0:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device], find_unused_parameters=True)
    return net
"""

# DDP when distributed, DataParallel otherwise: the corpus's script in the shape of an
# ImageNet training script (its findings are held by tests/unit/test_doctor_corpus.py)
WRAP_BY_MODE = (Path(__file__).parents[2] / "doctor_corpus" / "imagenet_style.py").read_text()


def test_a_checkpoint_resumed_into_the_same_wrapper_keeps_its_keys():
    # Uformer (DataParallel), swav and vicreg (DDP): the wrapper's state_dict is saved and
    # loaded back into the wrapper itself, so the `module.` keys match
    base = PRE + textwrap.dedent("""
    model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])
    {resume}
    if rank == 0:
        torch.save({{"state_dict": model.state_dict()}}, "c.pt.tmp")
    """)
    for resume in ("utils.load_checkpoint(model, 'c.pt')", "model.load_state_dict(torch.load('c.pt'))",
                   "restart_from_checkpoint('c.pt', state_dict=model)"):
        assert found(base.format(resume=resume), "ddp-state-dict-prefix") == [], resume
    assert found(base.format(resume="pass"), "ddp-state-dict-prefix") == [("ddp-state-dict-prefix", 15, "warning")]


def test_an_optimizer_before_the_ddp_wrap_trains_the_same_parameters():
    # stylegan2-pytorch, swav: DDP keeps the module's Parameter objects
    src = PRE + ("model = nn.Linear(2, 2).cuda()\nopt = torch.optim.Adam(model.parameters())\n"
                 "model = DDP(model, device_ids=[local_rank])\n")
    assert found(src, "optimizer-before-wrap") == []
    fsdp = src.replace("DDP(model, device_ids=[local_rank])", "FSDP(model)") + \
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
    assert found(fsdp, "optimizer-before-wrap") == [("optimizer-before-wrap", 12, "error")]


def test_data_parallel_under_a_gpu_count_the_distributed_path_sets_to_one():
    # T2T-ViT (timm's train.py): `if args.distributed: args.num_gpu = 1`, later
    # `if args.num_gpu > 1: model = nn.DataParallel(...)`: the single-process mode
    src = PRE + textwrap.dedent("""
    opts.distributed = int(os.environ['WORLD_SIZE']) > 1
    if opts.distributed:
        opts.num_gpu = 1
    net = nn.Linear(2, 2)
    if opts.num_gpu > 1:
        net = nn.DataParallel(net, device_ids=[*range(opts.num_gpu)]).cuda()
    else:
        net.cuda()
    if opts.distributed:
        net = DDP(net, device_ids=[local_rank])
    """)
    assert found(src, "data-parallel-in-ddp") == []
    unforced = src.replace("    opts.num_gpu = 1\n", "    pass\n")
    assert found(unforced, "data-parallel-in-ddp") == [("data-parallel-in-ddp", 17, "error")]


def test_data_parallel_where_the_set_up_pins_the_gpu_count_to_one_is_the_single_process_path(tmp_path):
    files = {"options.py": GPU_COUNT_SETUP, "model_utils.py": GPU_COUNT_WRAP, "train.py": GPU_COUNT_ENTRY}
    got = found_in(tmp_path, files)
    assert [f for f in got if f[1] == "data-parallel-in-ddp"] == []
    # the wrapped model is a parameter (its forward is out of view): no claim that it does not branch
    assert [f for f in got if f[1] == "find-unused-parameters"] == []


def test_data_parallel_in_the_non_distributed_branch_is_not_ddp():
    assert "data-parallel-in-ddp" not in rules(WRAP_BY_MODE)
    submodule = WRAP_BY_MODE.replace("        net = torch.nn.DataParallel(net).cuda()\n",
                                     "        net.body = torch.nn.DataParallel(net.body)\n")
    assert submodule != WRAP_BY_MODE and "data-parallel-in-ddp" not in rules(submodule)


def test_exclusive_branches_do_not_combine_for_two_statement_rules():
    src = PRE + textwrap.dedent("""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = nn.Linear(2, 2).cuda()
    if args.ddp:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = FSDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    assert "optimizer-before-wrap" not in rules(src)
    src = PRE + textwrap.dedent("""
    if args.plain:
        inner = nn.DataParallel(model)
    elif args.ddp:
        outer = DDP(inner, device_ids=[local_rank])
    """)
    assert "data-parallel-in-ddp" not in rules(src)
    # the same two statements on one path still meet (under FSDP, which replaces parameters)
    same_path = PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n" \
        "model = nn.Linear(2, 2).cuda()\nopt = torch.optim.SGD(model.parameters())\nmodel = FSDP(model)\n"
    assert "optimizer-before-wrap" in rules(same_path)


def test_data_parallel_behind_a_gpu_count_test_is_still_data_parallel():
    src = "import torch\nnet = torch.nn.Linear(4, 4)\nif torch.cuda.device_count() > 1:\n" \
          "    net = torch.nn.DataParallel(net)\n"
    assert found(src, "data-parallel") == [("data-parallel", 4, "warning")]
    # DistributedDataParallel imported under a short alias is not DataParallel
    ddp = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DP\n" \
          "net = DP(torch.nn.Linear(4, 4).cuda())\n"
    assert found(ddp, "data-parallel") == []


def test_data_parallel_and_ddp_under_opposite_answers_to_one_test_never_meet():
    # YOLOv6: DataParallel when the rank is -1 (one process), DDP when it is not, each
    # under a flag bound from that test and tested in an `if` of its own
    src = PRE + textwrap.dedent("""
    def parallel(args, model, device):
        single = device.type != "cpu" and args.rank == -1
        if single and torch.cuda.device_count() > 1:
            model = nn.DataParallel(model)
        several = device.type != "cpu" and args.rank != -1
        if several:
            model = DDP(model, device_ids=[args.local_rank])
        return model
    """)
    assert found(src, "data-parallel-in-ddp") == []
    # the look-alike: a flag that says nothing about the rank, so both wraps can meet
    meet = src.replace('args.rank == -1', 'args.fast')
    assert found(meet, "data-parallel-in-ddp") == [("data-parallel-in-ddp", 15, "error"),
                                                   ("data-parallel-in-ddp", 18, "error")]


def test_an_unneeded_find_unused_parameters_flag_is_advice():
    # flow_matching, vjepa2, yolov7-pytorch: the reason the flag is needed was out of
    # view (a label dropped in the loop, a forward in another file, a freeze after the
    # wrap); the flag costs time, never a wrong result
    from disttrain.doctor.analyzer import analyze_source

    src = PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank], find_unused_parameters=True)\n"
    assert found(src, "find-unused-parameters") == []
    advised = [(f.rule, f.severity) for f in analyze_source("s.py", src, advice=True)]
    assert advised == [("find-unused-parameters", "advice")]
