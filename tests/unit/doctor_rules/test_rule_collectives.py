"""collective-under-rank-guard, eval-gather-padded: collectives that some ranks skip or
that count padded samples.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import FSDP_AS_A_MODE, PRE, PRE_FSDP2, found, found_in, rule_severities

# diffusers (round 4): accelerator.save_state on the main process only, a collective
# under DeepSpeed or FSDP; the Trainer's save_state (a JSON of its state) is none
MAIN_PROCESS_SAVE_STATE = """
from accelerate import Accelerator
from accelerate.utils import DistributedType
accelerator = Accelerator()
for step in range(10):
    if accelerator.is_main_process:
        accelerator.save_state(f"state-{step}")
        trainer.save_state()
sharded = accelerator.state.deepspeed_plugin is not None  # the script supports DeepSpeed
"""

# DPR's train_dense_encoder.py: `val_av_rank_start_epoch` holds "rank" and is no rank
RANK_IN_A_QUANTITY = PRE + """
def eval_loss(net):
    dist.all_reduce(torch.zeros(1))
def eval_then_keep(cfg, epoch, net):
    if epoch >= cfg.rank_eval_start_epoch:
        eval_loss(net)
    if cfg.lora_rank > 0:
        dist.barrier()
eval_then_keep(None, 0, None)
"""

# nanoVLM: were the launcher's variables set? The same answer on every rank
LAUNCHER_VARIABLES = """
import datetime, os
import torch, torch.distributed as dist
def start():
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=20))
        side_group = dist.new_group(backend="gloo")
start()
"""

# Amphion: save_state under the main-process guard in a program that names neither
# DeepSpeed nor FSDP (its recipes launch plain multi-GPU Accelerate)
PLAIN_ACCELERATE_SAVE_STATE = """
import accelerate
accelerator = accelerate.Accelerator()
def keep(folder):
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save_state(folder)
keep("state")
"""


def test_a_helper_called_from_both_branches_of_a_rank_test_runs_on_every_rank():
    src = PRE + textwrap.dedent("""
    def share(t, src=0):
        dist.broadcast(t, src)
        return t
    def share_from_first(obj, t):
        if dist.get_rank() == 0:
            t = share(t)
        else:
            t = share(t)
        return t
    """)
    assert found(src, "collective-under-rank-guard") == []


def test_the_model_called_before_its_ddp_wrap_is_no_ddp_forward():
    src = PRE + (
        "model = nn.Linear(2, 2).cuda()\nif rank == 0:\n    model(x)\n"
        "model = DDP(model, device_ids=[local_rank])\n"
    )
    assert found(src, "collective-under-rank-guard") == []


def test_save_checkpoint_is_no_collective_on_a_lightning_without_its_barrier():
    # latent-diffusion: Lightning 1.4 APIs (removed in 2.0); save_checkpoint's barrier came in 2.1
    src = textwrap.dedent("""
    import os, signal
    import pytorch_lightning as pl
    from pytorch_lightning.trainer import Trainer
    trainer = Trainer.from_argparse_args(opts, accelerator="ddp")
    def on_signal(*_):
        if trainer.global_rank == 0:
            trainer.save_checkpoint(os.path.join(out_dir, "interrupted.ckpt"))
    signal.signal(signal.SIGUSR1, on_signal)
    """)
    assert found(src, "collective-under-rank-guard") == []
    modern = "import lightning as L\ntrainer = L.Trainer(strategy='ddp')\n" \
             "if trainer.global_rank == 0:\n    trainer.save_checkpoint('last.ckpt')\n"
    assert [f[0] for f in found(modern, "collective-under-rank-guard")] == ["collective-under-rank-guard"]


def test_a_method_of_another_object_is_not_this_file_s_method_of_that_name():
    # imagen-pytorch: `ema_unet.update()` is ema_pytorch's EMA.update, not Trainer.update
    src = PRE + textwrap.dedent("""
    from ema_pytorch import EMA
    class Fitter:
        def __init__(self, accelerator, net, averaged=True):
            self.accelerator = accelerator
            self.avg = EMA(net)
            self.averaged = averaged and accelerator.is_main_process
        def save(self):
            self.accelerator.wait_for_everyone()
        def update(self):
            if self.averaged:
                shadow = self.avg
                shadow.update()
            self.save()
    """)
    assert found(src, "collective-under-rank-guard") == []
    # the same method called on self under the guard still reaches the collective
    own = src.replace("shadow.update()", "self.save()")
    assert [f[0] for f in found(own, "collective-under-rank-guard")] == ["collective-under-rank-guard"]


def test_a_state_dict_on_the_path_where_fsdp_is_off_is_no_collective():
    assert found(FSDP_AS_A_MODE, "collective-under-rank-guard") == []
    on = FSDP_AS_A_MODE.replace("full if args.fsdp else model.state_dict()", "model.state_dict()")
    assert [f[0] for f in found(on, "collective-under-rank-guard")] == ["collective-under-rank-guard"]


def test_accelerate_save_state_on_the_main_process_only_is_a_warning():
    assert [f[:3] for f in found(MAIN_PROCESS_SAVE_STATE, "collective-under-rank-guard")] == [
        ("collective-under-rank-guard", 7, "warning")]
    balanced = MAIN_PROCESS_SAVE_STATE.replace("if accelerator.is_main_process:", "if accelerator.is_main_process or "
                                 "accelerator.distributed_type == DistributedType.DEEPSPEED:")
    assert found(balanced, "collective-under-rank-guard") == []


def test_a_name_that_holds_rank_but_is_a_quantity_is_no_rank_guard():
    assert found(RANK_IN_A_QUANTITY, "collective-under-rank-guard") == []
    guarded = RANK_IN_A_QUANTITY.replace("epoch >= cfg.rank_eval_start_epoch", "cfg.local_rank == 0")
    assert found(guarded, "collective-under-rank-guard") != []


def test_launcher_variables_present_is_no_rank_guard():
    assert found(LAUNCHER_VARIABLES, "collective-under-rank-guard") == []


def test_save_state_on_the_main_process_of_a_program_that_never_names_deepspeed():
    assert found(PLAIN_ACCELERATE_SAVE_STATE, "collective-under-rank-guard") == []
    ds = PLAIN_ACCELERATE_SAVE_STATE.replace("accelerate.Accelerator()",
                              "accelerate.Accelerator(deepspeed_plugin=accelerate.DeepSpeedPlugin())")
    assert [f[2] for f in found(ds, "collective-under-rank-guard")] == ["warning"]


def test_evaluation_of_the_ddp_model_on_rank_0_only():
    src = PRE + textwrap.dedent("""
    model = DDP(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).cuda(), device_ids=[local_rank])
    def score(net, batches):
        with torch.no_grad():
            for x in batches:
                net(x)
    for epoch in range(3):
        if rank == 0:
            score(model, held_out)
    """)
    assert ("collective-under-rank-guard", 19, "warning") in found(src)


def test_the_ddp_model_called_directly_under_a_guard():
    src = PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\nif rank == 0:\n    model(x)\n"
    assert found(src, "collective-under-rank-guard") == [("collective-under-rank-guard", 13, "warning")]


def test_an_early_return_on_rank_0_before_a_collective():
    src = PRE + textwrap.dedent("""
    def wrap_up(opts, t):
        if rank == 0:
            print("all passes run")
            return
        dist.all_reduce(t)
    """)
    assert found(src, "collective-under-rank-guard") == [("collective-under-rank-guard", 16, "error")]


def test_a_broadcast_based_loader_in_another_file_called_on_rank_0_only(tmp_path):
    data = """
    import torch.distributed as dist
    def read_split(path):
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    """
    main = PRE + "from data import read_split\nif rank == 0:\n    rows = read_split('rows.bin')\n"
    got = found_in(tmp_path, {"data.py": data, "main.py": main}, "collective-under-rank-guard")
    assert got == [("data.py", "collective-under-rank-guard", 5, "error")]


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
    def read_weights(path):
        blob = None
        if MPI.COMM_WORLD.Get_rank() == 0:
            blob = open(path, "rb").read()
        return MPI.COMM_WORLD.bcast(blob)
    """
    main = PRE + "import dist_util\nif rank == 0:\n    sd = dist_util.read_weights('m.pt')\n"
    got = found_in(tmp_path, {"dist_util.py": dist_util, "main.py": main}, "collective-under-rank-guard")
    assert got == [("dist_util.py", "collective-under-rank-guard", 7, "error")]


def test_a_training_all_reduce_does_not_make_an_eval_sampler_a_finding():
    src = (PRE_FSDP2 + "from torch.utils.data import DataLoader, DistributedSampler\n"
           "val_loader = DataLoader(val_set, sampler=DistributedSampler(val_set, shuffle=False))\n"
           "def train(loader):\n    for x in loader:\n        dist.all_reduce(x)\n"
           "def evaluate():\n    return [model(x) for x in val_loader]\n")
    assert not [r for r in rule_severities(src) if r[0] == "eval-gather-padded"]
    src += "def report(t):\n    for x in val_loader:\n        dist.all_reduce(t)\n"
    assert ("eval-gather-padded", "warning") in rule_severities(src)


def test_a_mode_flag_or_a_launcher_check_is_no_rank_guard():  # torch's FSDP optim utils; bench code
    flag = PRE_FSDP2 + (
        "def load(rank0_only, objects):\n    if rank0_only:\n        dist.broadcast_object_list(objects)\n"
    )
    env = PRE_FSDP2 + (
        "import os\nif 'RANK' in os.environ:\n    dist.barrier()\n"
        "if os.environ.get('RANK') is not None:\n    dist.barrier()\n"
    )
    for src in (flag, env):
        assert not [r for r in rule_severities(src) if r[0] == "collective-under-rank-guard"], src
    # A bare `rank` that nothing in view sets is a rank by its name alone: a warning that
    # says so. Once data flow makes it a rank, the same guard is an error.
    unseen = env.replace("'RANK' in os.environ", "rank == 0")
    assert ("collective-under-rank-guard", "warning") in rule_severities(unseen)
    seen = unseen.replace("import os\n", "import os\nrank = int(os.environ['RANK'])\n")
    assert ("collective-under-rank-guard", "error") in rule_severities(seen)
    spawned = PRE_FSDP2 + "def worker(rank, world):\n    if rank == 0:\n        dist.barrier()\n" \
        "torch.multiprocessing.spawn(worker, args=(2,), nprocs=2)\n"
    assert ("collective-under-rank-guard", "error") in rule_severities(spawned)


def test_fabric_gathers_over_its_padded_eval_loader():  # Lightning Fabric examples
    src = ("from lightning.fabric import Fabric\nfabric = Fabric()\n"
           "test_loader = fabric.setup_dataloaders(test_loader)\n"
           "def validate(model, data_loader):\n    loss = 0\n    for x, y in data_loader:\n"
           "        loss += model(x)\n    return fabric.all_gather(loss).sum()\n")
    assert ("eval-gather-padded", "warning") in rule_severities(src)
    off = src.replace("Fabric()", "Fabric(use_distributed_sampler=False)")
    assert not [r for r in rule_severities(off) if r[0] == "eval-gather-padded"]


def test_an_or_that_is_true_on_every_rank_in_one_mode_is_no_rank_guard():
    # with `--sync_every_rank` every rank passes: the barrier pairs up in that mode, and
    # the doctor cannot show a run where only rank 0 waits
    src = PRE + textwrap.dedent("""
    def sync(args):
        if rank == 0 and args.verbose or args.sync_every_rank:
            dist.barrier()
    """)
    assert found(src, "collective-under-rank-guard") == []
    # the look-alike: the other alternative is "one process", so under torchrun only rank 0 waits
    one_process = src.replace("rank == 0 and args.verbose or args.sync_every_rank", "rank == 0 or not args.distributed")
    assert found(one_process, "collective-under-rank-guard") == [("collective-under-rank-guard", 14, "error")]
