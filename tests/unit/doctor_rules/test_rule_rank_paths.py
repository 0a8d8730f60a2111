"""rank-local-exit, ema-before-broadcast, guard-true-on-every-rank,
full-state-dict-on-every-gpu: code paths that differ between ranks.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import PRE, found, found_in

# audiolm-pytorch's trainers: `and` binds before `or`, so the prompt and the rmtree of
# the shared results folder run on every rank whenever the second part is true
AND_BEFORE_OR = """
from shutil import rmtree
from accelerate import Accelerator
class Fitter:
    def __init__(self, folder, wipe=None):
        self.accelerator = Accelerator()
        self.is_main = self.accelerator.is_main_process
        if self.is_main and wipe is True or (wipe is None and input("wipe?") == "y"):
            rmtree(folder)
        self.accelerator.wait_for_everyone()
"""

WRITER_USER = """
import shutil
import torch
def score(folder, board=None):
    if board is not None:
        board.add_scalar("quality", 1.0, 0)
        shutil.rmtree(folder)
    torch.distributed.barrier()
"""

# mar: the writer exists on rank 0 only and is passed into another file's function,
# whose `if log_writer is not None:` is then a rank guard
RANK_ZERO_WRITER = PRE + """
from engine import score
from torch.utils.tensorboard import SummaryWriter
if rank == 0:
    board = SummaryWriter("boards")
else:
    board = None
score("generated", board=board)
"""

# CosyVoice: a join protocol (`info_dict` holds "inf"); LatentSync: a config path check
NOT_NONFINITE = PRE + """
def peers_done(group, info_dict):
    return False
for i, batch in enumerate(loader):
    if peers_done(group, info_dict):
        break
    loss = model(batch)
    if cfg.inference_weights == "":
        raise ValueError("no weights named")
"""

# LatentSync: a rank whose audio features fail to load skips the step the others train
SKIPPED_STEP = PRE + """
model = DDP(model, device_ids=[local_rank])
for step, batch in enumerate(loader):
    try:
        extra = featurize(batch["clip"])
    except Exception as err:
        print(err)
        continue
    loss = model(batch, extra)
    loss.backward()
    opt.step()
"""

# LSGM: the script is its own launcher: one Process per GPU, each with its own
# args.local_rank, so the --local_rank default is never what a process binds
OWN_LAUNCHER = """
import argparse, os
import torch
import torch.distributed as dist
from torch.multiprocessing import Process
def child(rank, size, work, args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group('nccl', rank=rank, world_size=size)
    work(args)
parser = argparse.ArgumentParser()
parser.add_argument('--local_rank', type=int, default=0)
parser.add_argument('--procs', type=int, default=1)
args = parser.parse_args()
children = []
for rank in range(args.procs):
    args.local_rank = rank
    c = Process(target=child, args=(rank, args.procs, print, args))
    c.start()
    children.append(c)
"""


def test_a_raise_behind_a_flag_off_by_default_that_no_caller_sets_cannot_run():
    # Latte's copy of clip_grad_norm_: error_if_nonfinite defaults to False, never passed
    src = PRE + textwrap.dedent("""
    def clip_norm(params, limit, error_if_nonfinite=False, clip=True):
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        if clip:
            if error_if_nonfinite and (norm.isnan() | norm.isinf()):
                raise RuntimeError("the gradient norm is not finite")
        return norm
    for step in range(10):
        clip_norm(model.parameters(), 1.0, clip=True)
    """)
    assert found(src, "rank-local-exit") == []
    passed = src.replace("clip=True)\n", "clip=True, error_if_nonfinite=True)\n")
    assert [f[0] for f in found(passed, "rank-local-exit")] == ["rank-local-exit"]


def test_an_ema_set_from_the_wrapped_model_after_the_wrap_is_synced():
    # efficientdet: ModelEmaV2(model) before DDP, then model_ema.set(model) after it
    src = PRE + textwrap.dedent("""
    from timm.utils import ModelEmaV2
    torch.manual_seed(42 + rank)
    model = nn.Linear(2, 2).cuda()
    model_ema = ModelEmaV2(model, decay=0.999)
    model = DDP(model, device_ids=[local_rank])
    model_ema.set(model)
    """)
    assert found(src, "ema-before-broadcast") == []
    unsynced = src.replace("model_ema.set(model)\n", "")
    assert [f[0] for f in found(unsynced, "ema-before-broadcast")] == ["ema-before-broadcast"]


def test_an_or_after_a_rank_test_and_something_runs_on_every_rank():
    assert [f[:2] for f in found(AND_BEFORE_OR, "guard-true-on-every-rank")] == [("guard-true-on-every-rank", 8)]
    fixed = AND_BEFORE_OR.replace("self.is_main and wipe is True or (wipe is None",
                            "self.is_main and (wipe is True or wipe is None")
    assert found(fixed, "guard-true-on-every-rank") == []


def test_a_folder_reset_with_no_guard_before_the_barrier_runs_on_every_rank():
    src = AND_BEFORE_OR.replace("self.is_main and wipe is True or ", "wipe is True or ")
    assert [f[:2] for f in found(src, "guard-true-on-every-rank")] == [("guard-true-on-every-rank", 9)]
    guarded = src.replace("            rmtree(folder)", "            if self.is_main:\n                rmtree(folder)")
    assert found(guarded, "guard-true-on-every-rank") == []


def test_a_rank_only_object_passed_to_another_file_guards_there(tmp_path):
    files = {"main.py": RANK_ZERO_WRITER, "engine.py": WRITER_USER}
    assert found_in(tmp_path, files, "guard-true-on-every-rank") == []
    made_everywhere = RANK_ZERO_WRITER.replace(
        'if rank == 0:\n    board = SummaryWriter("boards")\nelse:\n    board = None', 'board = SummaryWriter("boards")'
    )
    assert made_everywhere != RANK_ZERO_WRITER
    everyone = {"main.py": made_everywhere, "engine.py": WRITER_USER}
    assert [f[1] for f in found_in(tmp_path, everyone, "guard-true-on-every-rank")] == ["guard-true-on-every-rank"]


def test_a_name_holding_inf_is_no_non_finite_test():
    assert found(NOT_NONFINITE, "rank-local-exit") == []
    nan = NOT_NONFINITE.replace('cfg.inference_weights == ""', "torch.isnan(loss)")
    assert [f[1] for f in found(nan, "rank-local-exit")] == [19]


def test_a_rank_local_continue_before_the_ddp_backward_desynchronises_the_ranks():
    assert [f[1] for f in found(SKIPPED_STEP, "rank-local-exit")] == [18]
    single = SKIPPED_STEP.replace("model = DDP(model, device_ids=[local_rank])\n", "")
    assert found(single, "rank-local-exit") == []


def test_a_program_that_starts_its_own_processes_sets_each_local_rank():
    assert found(OWN_LAUNCHER, "guard-true-on-every-rank") == []
    torchrun = OWN_LAUNCHER.split("children = []")[0] + "child(0, 1, print, args)\n"
    assert [f[0] for f in found(torchrun, "guard-true-on-every-rank")] == ["guard-true-on-every-rank"]


def test_a_rank_local_exit_on_a_non_finite_loss():
    src = PRE + textwrap.dedent("""
    def fit(net, batches):
        for x in batches:
            loss = net(x).mean()
            value = loss.item()
            if not math.isfinite(value):
                print(f"the loss is {value}: giving up")
                sys.exit(1)
            loss.backward()
    """)
    assert found(src, "rank-local-exit") == [("rank-local-exit", 18, "warning")]
    reduced = src.replace("        value = loss.item()\n",
                          "        dist.all_reduce(loss)\n        value = loss.item()\n")
    assert reduced != src
    assert found(reduced, "rank-local-exit") == []


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
    ok = src.replace(
        "FullStateDictConfig(rank0_only=True)", "FullStateDictConfig(offload_to_cpu=True, rank0_only=True)"
    )
    assert found(ok, "full-state-dict-on-every-gpu") == []
