"""unguarded-save, non-atomic-save, checkpoint-missing-state: who writes a checkpoint,
how, and with what in it.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import RANK_ZERO_HELPERS, PRE, F5, found, found_in, findings, rules, rule_severities

# moco-v3 / simsiam: "single process, or rank 0 of each node" is still a guard
MOCO = PRE + """
def save_checkpoint(state, filename):
    torch.save(state, filename)
def main(args, model):
    if not args.multiprocessing_distributed or (args.multiprocessing_distributed and rank % 8 == 0):
        save_checkpoint({"m": model.state_dict()}, "c.pt")
main(None, None)
"""

# lerobot / EasyContext / qlora: the weights written in place by save_pretrained; the
# config and the processors saved next to them are small metadata, not reported again
HF_SAVE = PRE + """
def save(model, cfg, tokenizer, out_dir):
    if rank == 0:
        model.save_pretrained(out_dir)
        cfg.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
save(None, None, None, "out")
"""

# verl, parler-tts: a tokenizer's or a feature extractor's files are no training state
PROCESSORS = PRE + """
if rank == 0:
    feature_extractor.save_pretrained(out_dir)
    self.processing_class.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
"""

# verl: the tracker file is renamed into place, data.pt (saved just before) is not
VERL_SAVE = PRE + """
if rank == 0:
    torch.save(loader.state_dict(), os.path.join(step_dir, "data.pt"))
    tmp = tracker + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.rename(tmp, tracker)
"""

# OLMo-core: the state is written into the temporary working directory of a context
# manager that renames it into place
OLMO_SAVE = PRE + """
class Checkpointer:
    def save(self, d, state):
        with self._temporary_wd(d) as wd:
            self._save_train_state(d, wd, state)
    def _save_train_state(self, d, wd, state):
        train_dir = wd / "train"
        torch.save(state, train_dir / f"rank{rank}.pt")
"""

# jukebox: a debug dump of sampled data just before the process exits
DUMP = PRE + """
def save_outputs(data):
    torch.save(data, "data.pth.tar")
    dist.barrier()
    exit()
save_outputs(None)
"""

# DeepLearningExamples: the checkpoint is copied onto the last-checkpoint name in place
DLE = PRE + """
import shutil
def save_checkpoint(state, full_path, last_path):
    torch.save(state, full_path)
    shutil.copyfile(full_path, last_path)
if rank == 0:
    save_checkpoint({}, "checkpoint_0001.pth.tar", "checkpoint.pth.tar")
"""

# vall-e: the batch that ran out of memory is dumped under a name unique to the call
VALLE = PRE + """
from lhotse.utils import uuid4
def display_and_save_batch(batch, params):
    filename = f"{params.exp_dir}/batch-{uuid4()}.pt"
    torch.save(batch, filename)
display_and_save_batch(None, None)
"""

LSGM_TRAIN = """
from util import utils
utils.average_tensor(None)
"""

# LSGM: a save helper in util/utils.py, a module the training script imports, that
# nothing in the run calls
LSGM_UTILS = PRE + """
def save_checkpoint(state, is_best, save):
    filename = os.path.join(save, 'checkpoint.pth.tar')
    torch.save(state, filename)
def average_tensor(t):
    dist.all_reduce(t)
"""

# pytorch/examples ddp-tutorial-series/multigpu_torchrun.py
TORCHRUN_TRAINER = """
import os, datetime, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
class Trainer:
    def __init__(self, model, save_every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.gpu_id)
        self.model = DDP(model.to(self.gpu_id), device_ids=[self.gpu_id])
        self.save_every = save_every
    def _save_checkpoint(self, epoch):
        ckp = self.model.module.state_dict()
        torch.save(ckp, "checkpoint.pt.tmp")
        os.replace("checkpoint.pt.tmp", "checkpoint.pt")
        print(f"Epoch {epoch} | Training checkpoint saved")
    def train(self, max_epochs):
        for epoch in range(max_epochs):
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
"""


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


def test_a_local_rank_guard_says_the_script_runs_as_several_processes():
    # LLaVA under the HF Trainer: no init_process_group in view, saves under local_rank == 0
    src = textwrap.dedent("""
    import os, torch
    def safe_save(trainer, output_dir, weights):
        if trainer.args.local_rank == 0 or trainer.args.local_rank == -1:
            torch.save(weights, os.path.join(output_dir, 'mm_projector.bin'))
    """)
    assert [f[:1] + f[2:] for f in found(src, "unguarded-save")] == [("unguarded-save", "warning")]
    plain = "import torch\ndef save(w, p):\n    torch.save(w, p)\n"
    assert found(plain, "unguarded-save") == []


def test_torch_save_into_a_write_and_rename_context_is_atomic():
    # audiocraft: `with flashy.utils.write_and_rename(path) as f: torch.save(state, f)`
    src = "import torch, flashy\ndef save(state, path):\n    with flashy.utils.write_and_rename(path) as f:\n" \
          "        torch.save(state, f)\n"
    assert found(src, "non-atomic-save") == []
    plain = src.replace("flashy.utils.write_and_rename(path)", "open(path, 'wb')")
    assert found(plain, "non-atomic-save") == [("non-atomic-save", 4, "warning")]


def test_single_process_or_rank_zero_stays_a_guard():
    assert found(MOCO, "unguarded-save") == []


def test_save_pretrained_into_the_final_folder_is_not_atomic():
    assert [f[:2] for f in found(HF_SAVE, "non-atomic-save")] == [("non-atomic-save", 14)]
    aside = HF_SAVE.replace("model.save_pretrained(out_dir)", "model.save_pretrained(out_dir + '.tmp')\n"
                            "        os.replace(out_dir + '.tmp', out_dir)")
    assert found(aside, "non-atomic-save") == []


def test_a_processor_or_feature_extractor_save_is_not_a_checkpoint():
    assert [f[1] for f in found(PROCESSORS, "non-atomic-save")] == [15]


def test_a_move_of_another_file_does_not_make_a_save_atomic():
    assert [f[1] for f in found(VERL_SAVE, "non-atomic-save")] == [13]
    aside = VERL_SAVE.replace('os.path.join(step_dir, "data.pt")', "data_tmp").replace(
        "os.rename(tmp, tracker)", "os.rename(tmp, tracker)\n    os.replace(data_tmp, data_path)")
    assert found(aside, "non-atomic-save") == []


def test_accelerator_save_is_a_non_atomic_save():
    assert [f[1] for f in found(F5, "non-atomic-save")] == [9]


def test_a_save_into_a_temporary_working_directory_is_atomic():
    assert found(OLMO_SAVE, "non-atomic-save") == []
    direct = OLMO_SAVE.replace("with self._temporary_wd(d) as wd:", "with self._open_dir(d) as wd:")
    assert found(direct, "non-atomic-save") != []


def test_a_dump_right_before_exit_is_no_checkpoint():
    assert found(DUMP, "non-atomic-save") == []


def test_a_copy_of_a_checkpoint_onto_another_name_is_not_atomic():
    assert [f[1] for f in found(DLE, "non-atomic-save")] == [14, 15]
    aside = DLE.replace("shutil.copyfile(full_path, last_path)", "shutil.copyfile(full_path, last_path + '.tmp')")
    assert [f[1] for f in found(aside, "non-atomic-save")] == [14]


def test_a_file_named_by_uuid4_has_one_writer():
    assert found(VALLE, "unguarded-save") == []
    shared = VALLE.replace("batch-{uuid4()}.pt", "batch.pt")
    assert [f[2] for f in found(shared, "unguarded-save")] == ["error"]


def test_a_save_helper_of_an_imported_module_that_nothing_calls_is_not_judged(tmp_path):
    files = {"util/utils.py": LSGM_UTILS, "train_vae.py": LSGM_TRAIN}
    assert found_in(tmp_path, files, "unguarded-save") == []
    called = {**files, "train_vae.py": LSGM_TRAIN + "utils.save_checkpoint({}, False, 'out')\n"}
    assert [f[3] for f in found_in(tmp_path / "called", called, "unguarded-save")] == ["error"]
    alone = {"util/utils.py": LSGM_UTILS}  # nobody in view imports it: a caller out of view
    assert [f[3] for f in found_in(tmp_path / "alone", alone, "unguarded-save")] == ["warning"]


def test_a_non_atomic_save_through_a_rank_zero_wrapper_is_reported_at_the_call(tmp_path):
    main = PRE + textwrap.dedent("""
    import helpers
    def main(cfg, model):
        helpers.save_from_rank_zero({"model": model.state_dict()}, "weights.pth")
    """)
    got = found_in(tmp_path, {"helpers.py": RANK_ZERO_HELPERS, "main.py": main}, "non-atomic-save")
    assert got == [("main.py", "non-atomic-save", 14, "warning")]


def test_method_called_only_under_a_local_rank_guard_is_a_multi_node_warning():
    found = [f for f in findings(TORCHRUN_TRAINER) if f.rule in ("unguarded-save", "unguarded-log")]
    assert {(f.rule, f.severity) for f in found} == {("unguarded-save", "warning"),
                                                     ("unguarded-log", "warning")}
    assert all("local rank" in f.message and "node" in f.message for f in found)
    assert all("runs on every rank" not in f.message for f in found)


def test_method_called_only_under_a_global_rank_guard_is_fine():
    src = TORCHRUN_TRAINER.replace('self.gpu_id == 0 and', 'int(os.environ["RANK"]) == 0 and')
    assert [r for r in rules(src) if r in ("unguarded-save", "unguarded-log")] == []


def test_a_gpu_id_guard_is_a_local_rank_guard():  # ddp-tutorial-series/multigpu.py
    src = ("import os, torch, torch.distributed as dist\ndist.init_process_group('nccl', timeout=t)\n"
           "def save(gpu_id, m):\n    if gpu_id == 0:\n        torch.save(m, 'c.pt.tmp')\n")
    assert ("unguarded-save", "warning") in rule_severities(src)


def test_a_lightning_ddp_trainer_makes_the_script_multi_process():  # Lightning#4761
    src = "import lightning as L, torch\ntrainer = L.Trainer(strategy={s!r})\ntorch.save(m, 'm.pt')\n"
    assert ("unguarded-save", "error") in rule_severities(src.format(s="ddp"))
    assert not [r for r in rule_severities(src.format(s="auto")) if r[0] == "unguarded-save"]
