"""Round 10's causes (issue 26), fixed after its figures were recorded: each a small
program modelled on the held-back project where it was found. Each failed on the doctor
frozen for round 10's review (commit be2c3dd)."""

from __future__ import annotations

from test_doctor_dataflow import PRE, found, found_in  # noqa: F401  (shared helpers)

# Amphion's VALL-E trainer: dynamic batches built for the whole job, each split over the
# job's process count but picked by the node-local index
AMPHION = """
import numpy as np
from accelerate import Accelerator
accelerator = Accelerator()
def build(batch_sampler):
    np.random.shuffle(batch_sampler)
    return [x[accelerator.local_process_index : : accelerator.num_processes] for x in batch_sampler]
loader = build(list(range(8)))
"""


def test_a_batch_split_over_the_job_but_picked_by_the_local_index_is_found():
    assert [f[:2] for f in found(AMPHION, "shard-by-local-rank")] == [("shard-by-local-rank", 7)]
    glob = AMPHION.replace("local_process_index", "process_index")
    assert found(glob, "shard-by-local-rank") == []
    per_node = AMPHION.replace("accelerator.num_processes]", "torch.cuda.device_count()]")
    assert found(per_node, "shard-by-local-rank") == []


# LSGM: the scaled gradients are all-reduced by hand (a helper in utils) before
# scaler.step unscales them: every rank sees the same inf/nan
LSGM = PRE + """
from torch.cuda.amp import GradScaler
def average_gradients(params, is_distributed):
    for param in params:
        if param.requires_grad:
            dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
            param.grad.data /= dist.get_world_size()
def train(model, optimizer, loader):
    grad_scalar = GradScaler(2**10)
    for x in loader:
        loss = model(x)
        grad_scalar.scale(loss).backward()
        average_gradients(model.parameters(), True)
        grad_scalar.step(optimizer)
        grad_scalar.update()
train(None, None, [])
"""


def test_gradients_reduced_by_hand_before_the_scaler_step_need_no_synced_scaler():
    assert found(LSGM, "gradscaler-unsynced") == []
    late = LSGM.replace("        average_gradients(model.parameters(), True)\n        grad_scalar.step(optimizer)\n",
                        "        grad_scalar.step(optimizer)\n        average_gradients(model.parameters(), True)\n")
    assert [f[2] for f in found(late, "gradscaler-unsynced")] == ["warning"]
    unscaled = LSGM.replace("        average_gradients(model.parameters(), True)\n",
                            "        grad_scalar.unscale_(optimizer)\n        average_gradients(model.parameters(), True)\n")
    assert [f[2] for f in found(unscaled, "gradscaler-unsynced")] == ["warning"]


# LSGM: the script is its own launcher: one Process per GPU, each with its own
# args.local_rank, so the --local_rank default is never what a process binds
LSGM_LAUNCH = """
import argparse, os
import torch
import torch.distributed as dist
from torch.multiprocessing import Process
def init_processes(rank, size, fn, args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend='nccl', init_method='env://', rank=rank, world_size=size)
    fn(args)
parser = argparse.ArgumentParser()
parser.add_argument('--local_rank', type=int, default=0)
parser.add_argument('--num_process_per_node', type=int, default=1)
args = parser.parse_args()
processes = []
for rank in range(args.num_process_per_node):
    args.local_rank = rank
    p = Process(target=init_processes, args=(rank, args.num_process_per_node, print, args))
    p.start()
    processes.append(p)
"""


def test_a_program_that_starts_its_own_processes_sets_each_local_rank():
    assert found(LSGM_LAUNCH, "guard-true-on-every-rank") == []
    torchrun = LSGM_LAUNCH.split("processes = []")[0] + "init_processes(0, 1, print, args)\n"
    assert [f[0] for f in found(torchrun, "guard-true-on-every-rank")] == ["guard-true-on-every-rank"]


# fast-autoaugment: the ranks other than the master bind SummaryWriter to a dummy class
FAA = PRE + """
is_master = rank == 0
if not is_master:
    from metrics import SummaryWriterDummy as SummaryWriter
else:
    from tensorboardX import SummaryWriter
writers = [SummaryWriter(log_dir=x) for x in ['train', 'valid']]
"""


def test_a_summary_writer_bound_to_a_dummy_on_the_other_ranks_is_rank_aware():
    assert found(FAA, "unguarded-log") == []
    real = FAA.replace("from metrics import SummaryWriterDummy as SummaryWriter",
                       "from tensorboard_other import SummaryWriter")
    assert [f[0] for f in found(real, "unguarded-log")] == ["unguarded-log"]


# HALOs: the resume reads scheduler.pt (a SequentialLR's state, no tensor) beside the
# optimizer's state (GPU tensors)
HALOS = PRE + """
def resume(path, optimizer, scheduler):
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
resume("ckpt", None, None)
"""


def test_a_scheduler_state_needs_no_map_location():
    assert [f[1] for f in found(HALOS, "load-without-map-location")] == [13]


# demucs: dora's distrib.init (out of view) binds each rank's device, then starts the group
DEMUCS = """
import torch
from torch.nn.parallel.distributed import DistributedDataParallel
from dora import distrib as dora_distrib
rank, world_size = 0, 1
def init():
    global rank, world_size
    if not torch.distributed.is_initialized():
        dora_distrib.init()
    rank = dora_distrib.rank()
    world_size = dora_distrib.world_size()
def average(metrics):
    tensor = torch.tensor(list(metrics) + [1], device='cuda', dtype=torch.float32)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor
def wrap(model):
    if world_size == 1:
        return model
    return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()],
                                   output_device=torch.cuda.current_device())
init()
"""


def test_doras_init_binds_the_device():
    assert found(DEMUCS, "missing-set-device") == []
    other = DEMUCS.replace("from dora import distrib as dora_distrib", "from mylib import distrib as dora_distrib")
    assert [f[2] for f in found(other, "missing-set-device")] == ["warning"]


# Amphion: save_state under the main-process guard in a program that names neither
# DeepSpeed nor FSDP (its recipes launch plain multi-GPU Accelerate)
AMPHION_SAVE = """
import accelerate
accelerator = accelerate.Accelerator()
def train(path):
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save_state(path)
train("ckpt")
"""


def test_save_state_on_the_main_process_of_a_program_that_never_names_deepspeed():
    assert found(AMPHION_SAVE, "collective-under-rank-guard") == []
    ds = AMPHION_SAVE.replace("accelerate.Accelerator()",
                              "accelerate.Accelerator(deepspeed_plugin=accelerate.DeepSpeedPlugin())")
    assert [f[2] for f in found(ds, "collective-under-rank-guard")] == ["warning"]


# LSGM: a save helper in util/utils.py, a module the training script imports, that
# nothing in the run calls
LSGM_UTILS = PRE + """
def save_checkpoint(state, is_best, save):
    filename = os.path.join(save, 'checkpoint.pth.tar')
    torch.save(state, filename)
def average_tensor(t):
    dist.all_reduce(t)
"""
LSGM_TRAIN = """
from util import utils
utils.average_tensor(None)
"""


def test_a_save_helper_of_an_imported_module_that_nothing_calls_is_not_judged(tmp_path):
    files = {"util/utils.py": LSGM_UTILS, "train_vae.py": LSGM_TRAIN}
    assert found_in(tmp_path, files, "unguarded-save") == []
    called = {**files, "train_vae.py": LSGM_TRAIN + "utils.save_checkpoint({}, False, 'out')\n"}
    assert [f[3] for f in found_in(tmp_path / "called", called, "unguarded-save")] == ["error"]
    alone = {"util/utils.py": LSGM_UTILS}  # nobody in view imports it: a caller out of view
    assert [f[3] for f in found_in(tmp_path / "alone", alone, "unguarded-save")] == ["warning"]
