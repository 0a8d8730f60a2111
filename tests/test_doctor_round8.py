"""Round 7's causes (issue 26), fixed after its figures were recorded: each a small
program modelled on the held-back project where it was found, most frequent false
findings first, then the misses. Each failed on the doctor frozen for round 7's review
(commit dd30f7a)."""

from __future__ import annotations

from test_doctor_dataflow import PRE, found, found_in  # noqa: F401  (shared helpers)

# ----- false findings ------------------------------------------------------------------

# DPR's options.py: set-up diagnostics that name this process (its rank as a %-argument
# of a logger call, its SLURM ids); CosyVoice: a message built with the rank appended
DPR_LOGS = PRE + """
import logging
logging.basicConfig(level=logging.INFO)
logger = logging.getLogger()
def setup_cfg_gpu(cfg):
    logger.info("CFG's local_rank=%s", cfg.local_rank)
    proc_id = os.environ.get("SLURM_PROCID")
    logger.info("SLURM_PROCID %s", proc_id)
    logger.info("16-bits training: %s ", cfg.fp16)
def log_per_step(loss):
    log_str = "loss {:.6f} ".format(loss)
    log_str += " rank {}".format(rank)
    logging.debug(log_str)
setup_cfg_gpu(None)
log_per_step(0.0)
"""


def test_a_log_line_that_names_this_process_is_per_rank_on_purpose():
    assert [f[1] for f in found(DPR_LOGS, "unguarded-log")] == [19]  # only the fp16 line


# nanoVLM, LatentSync: each rank's own error report
ERROR_REPORTS = PRE + """
def load(names):
    out = []
    for name in names:
        try:
            out.append(open(name).read())
        except Exception as e:
            print(f"Warning: Failed to load dataset shard '{name}'. Error: {e}")
            continue
    return out
def read_video(path):
    if not os.path.exists(path):
        print("Error: Could not open video.")
        return None
    print("Snapshot not found. Training from scratch")
load(["a"])
read_video("v.mp4")
"""


def test_a_ranks_own_error_report_is_no_repeated_log_line():
    assert [f[1] for f in found(ERROR_REPORTS, "unguarded-log")] == [25]


# DPR's train_dense_encoder.py: `val_av_rank_start_epoch` holds "rank" and is no rank
DPR_VALIDATE = PRE + """
def validate_nll(model):
    dist.all_reduce(torch.zeros(1))
def validate_and_save(cfg, epoch, model):
    if epoch >= cfg.val_av_rank_start_epoch:
        validate_nll(model)
    if cfg.lora_rank > 0:
        dist.barrier()
validate_and_save(None, 0, None)
"""


def test_a_name_that_holds_rank_but_is_a_quantity_is_no_rank_guard():
    assert found(DPR_VALIDATE, "collective-under-rank-guard") == []
    guarded = DPR_VALIDATE.replace("epoch >= cfg.val_av_rank_start_epoch", "cfg.local_rank == 0")
    assert found(guarded, "collective-under-rank-guard") != []


# nanoVLM: were the launcher's variables set? The same answer on every rank
NANOVLM = """
import datetime, os
import torch, torch.distributed as dist
def main():
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
        pg = dist.new_group(backend="gloo")
main()
"""


def test_launcher_variables_present_is_no_rank_guard():
    assert found(NANOVLM, "collective-under-rank-guard") == []


# DPR: the helper wraps in DataParallel when n_gpu > 1 and in DDP when local_rank != -1;
# the set-up in another file sets n_gpu = 1 beside each init_process_group
DPR_OPTIONS = """
import torch
def setup_cfg_gpu(cfg):
    if cfg.local_rank == -1:
        cfg.n_gpu = torch.cuda.device_count()
    else:
        torch.cuda.set_device(cfg.local_rank)
        torch.distributed.init_process_group(backend="nccl")
        cfg.n_gpu = 1
    return cfg
"""
DPR_MODEL_UTILS = """
import torch
def setup_for_distributed_mode(model, device, n_gpu=1, local_rank=-1):
    model.to(device)
    if n_gpu > 1:
        model = torch.nn.DataParallel(model)
    if local_rank != -1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device], find_unused_parameters=True)
    return model
"""
DPR_TRAIN = """
from options import setup_cfg_gpu
from model_utils import setup_for_distributed_mode
def main(cfg, model):
    cfg = setup_cfg_gpu(cfg)
    model = setup_for_distributed_mode(model, cfg.device, cfg.n_gpu, cfg.local_rank)
main(None, None)
"""


def test_data_parallel_where_the_set_up_pins_the_gpu_count_to_one_is_the_single_process_path(tmp_path):
    files = {"options.py": DPR_OPTIONS, "model_utils.py": DPR_MODEL_UTILS, "train.py": DPR_TRAIN}
    got = found_in(tmp_path, files)
    assert [f for f in got if f[1] == "data-parallel-in-ddp"] == []
    # the wrapped model is a parameter (its forward is out of view): no claim that it does not branch
    assert [f for f in got if f[1] == "find-unused-parameters"] == []


# CosyVoice: a join protocol (`info_dict` holds "inf"); LatentSync: a config path check
NOT_NONFINITE = PRE + """
def join(group, info_dict):
    return False
for batch_idx, batch in enumerate(loader):
    if join(group, info_dict):
        break
    loss = model(batch)
    if cfg.inference_ckpt_path == "":
        raise ValueError("no path")
"""


def test_a_name_holding_inf_is_no_non_finite_test():
    assert found(NOT_NONFINITE, "rank-local-exit") == []
    nan = NOT_NONFINITE.replace('cfg.inference_ckpt_path == ""', "torch.isnan(loss)")
    assert [f[1] for f in found(nan, "rank-local-exit")] == [19]


# verl: each rank loads back its own shard, saved offloaded to the CPU
VERL_LOAD = PRE + """
path = os.path.join(ckpt, f"model_world_size_{world}_rank_{rank}.pt")
local_path = copy_to_local(path)
state = torch.load(local_path, weights_only=False)
"""


def test_a_per_rank_shard_needs_no_map_location():
    assert found(VERL_LOAD, "load-without-map-location") == []
    shared = VERL_LOAD.replace('f"model_world_size_{world}_rank_{rank}.pt"', '"model.pt"')
    assert found(shared, "load-without-map-location") != []


# verl, parler-tts: a tokenizer's or a feature extractor's files are no training state
PROCESSORS = PRE + """
if rank == 0:
    feature_extractor.save_pretrained(out_dir)
    self.processing_class.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
"""


def test_a_processor_or_feature_extractor_save_is_not_a_checkpoint():
    assert [f[1] for f in found(PROCESSORS, "non-atomic-save")] == [15]


# ----- misses --------------------------------------------------------------------------

# verl: the tracker file is renamed into place, data.pt (saved just before) is not
VERL_SAVE = PRE + """
if rank == 0:
    torch.save(loader.state_dict(), os.path.join(step_dir, "data.pt"))
    tmp = tracker + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.rename(tmp, tracker)
"""


def test_a_move_of_another_file_does_not_make_a_save_atomic():
    assert [f[1] for f in found(VERL_SAVE, "non-atomic-save")] == [13]
    aside = VERL_SAVE.replace('os.path.join(step_dir, "data.pt")', "data_tmp").replace(
        "os.rename(tmp, tracker)", "os.rename(tmp, tracker)\n    os.replace(data_tmp, data_path)")
    assert found(aside, "non-atomic-save") == []


# F5-TTS: accelerator.save is Accelerate's torch.save; and even_batches turned off
F5 = """
import os
from accelerate import Accelerator
class Trainer:
    def __init__(self):
        self.accelerator = Accelerator()
    def save_checkpoint(self, checkpoint, path):
        if self.accelerator.is_main_process:
            self.accelerator.save(checkpoint, f"{path}/model_last.pt")
    def train(self, loader):
        self.accelerator.even_batches = False
        for batch in loader:
            self.accelerator.backward(self.model(batch))
"""


def test_accelerator_save_is_a_non_atomic_save():
    assert [f[1] for f in found(F5, "non-atomic-save")] == [9]


def test_even_batches_off_gives_ranks_uneven_batch_counts():
    assert [f[1] for f in found(F5, "uneven-batches")] == [11]
    joined = F5.replace("        for batch in loader:", "        with self.accelerator.join_uneven_inputs([self.model]):\n"
                        "          for batch in loader:")
    assert found(joined, "uneven-batches") == []


# LatentSync: init_process_group(**kwargs), and the one caller passes no timeout
LATENTSYNC_INIT = """
import os, torch, torch.distributed as dist
def init_dist(backend="nccl", **kwargs):
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, **kwargs)
def main():
    init_dist()
main()
"""


def test_a_timeout_passed_through_kwargs_by_no_caller_is_none():
    assert [f[1] for f in found(LATENTSYNC_INIT, "init-without-timeout")] == [5]
    passed = LATENTSYNC_INIT.replace("    init_dist()", "    init_dist(timeout=t)")
    assert found(passed, "init-without-timeout") == []


# LatentSync: a rank whose audio features fail to load skips the step the others train
LATENTSYNC_LOOP = PRE + """
model = DDP(model, device_ids=[local_rank])
for step, batch in enumerate(loader):
    try:
        feats = encoder(batch["video_path"])
    except Exception as e:
        print(e)
        continue
    loss = model(batch, feats)
    loss.backward()
    opt.step()
"""


def test_a_rank_local_continue_before_the_ddp_backward_desynchronises_the_ranks():
    assert [f[1] for f in found(LATENTSYNC_LOOP, "rank-local-exit")] == [18]
    single = LATENTSYNC_LOOP.replace("model = DDP(model, device_ids=[local_rank])\n", "")
    assert found(single, "rank-local-exit") == []


# DPR: the data is sharded by the node-local rank
DPR_SHARD = PRE + """
class Trainer:
    def __init__(self, cfg):
        self.shard_id = cfg.local_rank if cfg.local_rank != -1 else 0
        self.num_shards = cfg.distributed_world_size
sampler = torch.utils.data.DistributedSampler(ds, rank=local_rank)
"""


def test_data_sharded_by_the_local_rank_repeats_on_every_node():
    assert [f[1] for f in found(DPR_SHARD, "shard-by-local-rank")] == [14, 16]
    fixed = DPR_SHARD.replace("cfg.local_rank if cfg.local_rank != -1 else 0", "dist.get_rank()").replace(
        "rank=local_rank", "rank=rank")
    assert found(fixed, "shard-by-local-rank") == []


# ----- an earlier round's false errors ---------------------------------------------------

# efficientvit (round 5): the entry script calls `setup.setup_dist_env(args.gpu)`, out of
# view, and the trainer in view uses CUDA: what the doctor could not see is a warning
EFFICIENTVIT_TRAIN = """
from efficientvit.apps import setup
from trainer import Trainer
def main(args):
    setup.setup_dist_env(args.gpu)
    Trainer().train()
if __name__ == "__main__":
    main(None)
"""
EFFICIENTVIT_TRAINER = """
import torch, torch.distributed
def dist_init():
    torch.distributed.init_process_group(backend="nccl")
class Trainer:
    def train(self):
        x = torch.zeros(1).cuda()
"""


def test_a_set_up_helper_out_of_view_in_the_entry_script_makes_missing_set_device_a_warning(tmp_path):
    got = found_in(tmp_path, {"train.py": EFFICIENTVIT_TRAIN, "trainer.py": EFFICIENTVIT_TRAINER},
                   "missing-set-device")
    assert [f[3] for f in got] == ["warning"]


# llm.c, open_lm (rounds 1 and 5): an error report just before this rank stops with a
# failure, and a line naming a device built from the local rank; apex's profiling stop
# (`quit()`, a normal end) stays a repeated line
STOPS = PRE + """
def peek(header):
    if header[0] != 20240520:
        print("---> HINT: Are you passing in a correct file with --input_bin?")
        exit(1)
    if header[1] is None:
        print(f"--hf-fsdp-block {header} not found")
        return -1
device = f"cuda:{local_rank}"
print(f"using device: {device}")
print("Profiling ended")
quit()
"""


def test_an_error_report_before_a_failing_exit_and_a_rank_device_line_are_per_rank():
    assert [f[1] for f in found(STOPS, "unguarded-log")] == [21]
