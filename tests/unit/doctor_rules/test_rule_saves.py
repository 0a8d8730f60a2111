"""unguarded-save, non-atomic-save, checkpoint-missing-state: who writes a checkpoint,
how, and with what in it.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import ACCELERATE_TRAINER, PRE, RANK_ZERO_HELPERS, findings, found, found_in, rule_severities, rules

from disttrain.doctor.analyzer import analyze_paths, analyze_source

# moco-v3 / simsiam: "single process, or rank 0 of each node" is still a guard
EITHER_GUARD = PRE + """
def write_state(state, where):
    torch.save(state, where)
def main(opts, net):
    if not opts.multiprocessing_distributed or (opts.multiprocessing_distributed and rank % 8 == 0):
        write_state({"net": net.state_dict()}, "state.pt")
main(None, None)
"""

# lerobot / EasyContext / qlora: the weights written in place by save_pretrained; the
# config and the processors saved next to them are small metadata, not reported again
PRETRAINED_IN_PLACE = PRE + """
def export(net, cfg, tokenizer, target):
    if rank == 0:
        net.save_pretrained(target)
        cfg.save_pretrained(target)
        tokenizer.save_pretrained(target)
export(None, None, None, "exported")
"""

# verl, parler-tts: a tokenizer's or a feature extractor's files are no training state
METADATA_SAVES = PRE + """
if rank == 0:
    feature_extractor.save_pretrained(export_dir)
    self.processing_class.save_pretrained(export_dir)
    net.save_pretrained(export_dir)
"""

# verl: the tracker file is renamed into place, data.pt (saved just before) is not
RENAME_OF_ANOTHER_FILE = PRE + """
if rank == 0:
    torch.save(loader.state_dict(), os.path.join(step_dir, "loader.pt"))
    partial = latest + ".tmp"
    with open(partial, "w") as out:
        out.write(str(step))
    os.rename(partial, latest)
"""

# OLMo-core: the state is written into the temporary working directory of a context
# manager that renames it into place
TEMPORARY_WORK_DIR = PRE + """
class Saver:
    def save(self, d, state):
        with self._temporary_wd(d) as wd:
            self._write_shards(d, wd, state)
    def _write_shards(self, d, wd, state):
        shard_dir = wd / "shards"
        torch.save(state, shard_dir / f"part{rank}.pt")
"""

# jukebox: a debug dump of sampled data just before the process exits
DUMP_BEFORE_EXIT = PRE + """
def dump_samples(samples):
    torch.save(samples, "samples.pt")
    dist.barrier()
    exit()
dump_samples(None)
"""

# DeepLearningExamples: the checkpoint is copied onto the last-checkpoint name in place
COPY_ONTO_LAST = PRE + """
import shutil
def keep(state, numbered, latest):
    torch.save(state, numbered)
    shutil.copyfile(numbered, latest)
if rank == 0:
    keep({}, "state-0001.pt", "state-latest.pt")
"""

# vall-e: the batch that ran out of memory is dumped under a name unique to the call
UNIQUE_NAME = PRE + """
from lhotse.utils import uuid4
def keep_failing_batch(batch, opts):
    where = f"{opts.out}/oom-{uuid4()}.pt"
    torch.save(batch, where)
keep_failing_batch(None, None)
"""

IMPORTER = """
from util import utils
utils.mean_over_ranks(None)
"""

# LSGM: a save helper in util/utils.py, a module the training script imports, that
# nothing in the run calls
UNCALLED_SAVE_HELPER = PRE + """
def store(state, folder):
    where = os.path.join(folder, 'state.pt')
    torch.save(state, where)
def mean_over_ranks(t):
    dist.all_reduce(t)
"""

# pytorch/examples ddp-tutorial-series/multigpu_torchrun.py
LOCAL_RANK_TRAINER = """
import os, datetime, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
class Runner:
    def __init__(self, net, every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.gpu_id)
        self.net = DDP(net.to(self.gpu_id), device_ids=[self.gpu_id])
        self.every = every
    def _store(self, epoch):
        weights = self.net.module.state_dict()
        torch.save(weights, "weights.pt.tmp")
        os.replace("weights.pt.tmp", "weights.pt")
        print(f"stored the weights after pass {epoch}")
    def fit(self, passes):
        for epoch in range(passes):
            if self.gpu_id == 0 and epoch % self.every == 0:
                self._store(epoch)
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
"""


def test_a_main_process_decorator_guards_the_save():
    src = PRE + (
        "from utils import main_process\n@main_process\ndef save(m, p):\n    torch.save(m, p)\nsave(1, 'c.pt')\n"
    )
    assert found(src, "unguarded-save") == []


def test_a_per_rank_file_name_held_in_a_variable():
    src = PRE + textwrap.dedent("""
    def keep_memory_bank(bank, opts):
        bank_file = os.path.join(opts.out, "bank" + str(opts.rank) + ".pt")
        torch.save({"bank": bank}, bank_file)
    keep_memory_bank(None, None)
    """)
    assert found(src, "unguarded-save") == []


def test_the_spawn_index_of_a_multi_node_launcher_is_a_local_rank():
    src = textwrap.dedent("""
    import datetime, torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    def run(index, per_node, opts):
        opts.gpu = index
        opts.rank = opts.rank * per_node + index
        torch.cuda.set_device(opts.gpu)
        dist.init_process_group("nccl", rank=opts.rank, timeout=datetime.timedelta(minutes=5))
        if opts.gpu == 0:
            torch.save({}, "last.pt")
    mp.spawn(run, nprocs=8, args=(8, None))
    """)
    assert found(src, "unguarded-save") == [("unguarded-save", 11, "warning")]


def test_a_local_rank_guard_says_the_script_runs_as_several_processes():
    # LLaVA under the HF Trainer: no init_process_group in view, saves under local_rank == 0
    src = textwrap.dedent("""
    import os, torch
    def keep_adapter(trainer, folder, weights):
        if trainer.args.local_rank in (0, -1):
            torch.save(weights, os.path.join(folder, 'adapter.bin'))
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
    assert found(EITHER_GUARD, "unguarded-save") == []


def test_save_pretrained_into_the_final_folder_is_not_atomic():
    assert [f[:2] for f in found(PRETRAINED_IN_PLACE, "non-atomic-save")] == [("non-atomic-save", 14)]
    aside = PRETRAINED_IN_PLACE.replace("net.save_pretrained(target)", "net.save_pretrained(target + '.tmp')\n"
                            "        os.replace(target + '.tmp', target)")
    assert found(aside, "non-atomic-save") == []


def test_a_processor_or_feature_extractor_save_is_not_a_checkpoint():
    assert [f[1] for f in found(METADATA_SAVES, "non-atomic-save")] == [15]


def test_a_move_of_another_file_does_not_make_a_save_atomic():
    assert [f[1] for f in found(RENAME_OF_ANOTHER_FILE, "non-atomic-save")] == [13]
    aside = RENAME_OF_ANOTHER_FILE.replace('os.path.join(step_dir, "loader.pt")', "loader_tmp").replace(
        "os.rename(partial, latest)", "os.rename(partial, latest)\n    os.replace(loader_tmp, loader_path)")
    assert found(aside, "non-atomic-save") == []


def test_accelerator_save_is_a_non_atomic_save():
    assert [f[1] for f in found(ACCELERATE_TRAINER, "non-atomic-save")] == [9]


def test_a_save_into_a_temporary_working_directory_is_atomic():
    assert found(TEMPORARY_WORK_DIR, "non-atomic-save") == []
    direct = TEMPORARY_WORK_DIR.replace("with self._temporary_wd(d) as wd:", "with self._open_dir(d) as wd:")
    assert found(direct, "non-atomic-save") != []


def test_a_dump_right_before_exit_is_no_checkpoint():
    assert found(DUMP_BEFORE_EXIT, "non-atomic-save") == []


def test_a_copy_of_a_checkpoint_onto_another_name_is_not_atomic():
    assert [f[1] for f in found(COPY_ONTO_LAST, "non-atomic-save")] == [14, 15]
    aside = COPY_ONTO_LAST.replace("shutil.copyfile(numbered, latest)", "shutil.copyfile(numbered, latest + '.tmp')")
    assert [f[1] for f in found(aside, "non-atomic-save")] == [14]


def test_a_file_named_by_uuid4_has_one_writer():
    assert found(UNIQUE_NAME, "unguarded-save") == []
    shared = UNIQUE_NAME.replace("oom-{uuid4()}.pt", "oom.pt")
    assert [f[2] for f in found(shared, "unguarded-save")] == ["error"]


def test_a_save_helper_of_an_imported_module_that_nothing_calls_is_not_judged(tmp_path):
    files = {"util/utils.py": UNCALLED_SAVE_HELPER, "train_vae.py": IMPORTER}
    assert found_in(tmp_path, files, "unguarded-save") == []
    called = {**files, "train_vae.py": IMPORTER + "utils.store({}, 'out')\n"}
    assert [f[3] for f in found_in(tmp_path / "called", called, "unguarded-save")] == ["error"]
    alone = {"util/utils.py": UNCALLED_SAVE_HELPER}  # nobody in view imports it: a caller out of view
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
    found = [f for f in findings(LOCAL_RANK_TRAINER) if f.rule in ("unguarded-save", "unguarded-log")]
    assert {(f.rule, f.severity) for f in found} == {("unguarded-save", "warning"),
                                                     ("unguarded-log", "warning")}
    assert all("local rank" in f.message and "node" in f.message for f in found)
    assert all("runs on every rank" not in f.message for f in found)


def test_method_called_only_under_a_global_rank_guard_is_fine():
    src = LOCAL_RANK_TRAINER.replace('self.gpu_id == 0 and', 'int(os.environ["RANK"]) == 0 and')
    assert [r for r in rules(src) if r in ("unguarded-save", "unguarded-log")] == []


def test_a_gpu_id_guard_is_a_local_rank_guard():  # ddp-tutorial-series/multigpu.py
    src = ("import os, torch, torch.distributed as dist\ndist.init_process_group('nccl', timeout=t)\n"
           "def save(gpu_id, m):\n    if gpu_id == 0:\n        torch.save(m, 'c.pt.tmp')\n")
    assert ("unguarded-save", "warning") in rule_severities(src)


def test_a_lightning_ddp_trainer_makes_the_script_multi_process():  # Lightning#4761
    src = "import lightning as L, torch\ntrainer = L.Trainer(strategy={s!r})\ntorch.save(m, 'm.pt')\n"
    assert ("unguarded-save", "error") in rule_severities(src.format(s="ddp"))
    assert not [r for r in rule_severities(src.format(s="auto")) if r[0] == "unguarded-save"]


RESUMING = PRE + """
start = torch.load("run/last.pt", map_location="cpu", weights_only=True)
for epoch in range(start["epoch"], 10):
    for x in loader:
        optimizer.zero_grad()
    if rank == 0:
        torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, "run/tmp.pt")
        os.replace("run/tmp.pt", "run/last.pt")
"""


def test_a_checkpoint_a_run_resumes_from_needs_its_rng_state():
    assert found(RESUMING, "checkpoint-missing-state") == [("checkpoint-missing-state", 17, "warning")]
    with_rng = RESUMING.replace('"epoch": epoch}', '"epoch": epoch, "rng": torch.get_rng_state()}')
    assert found(with_rng, "checkpoint-missing-state") == []
    # the same save in a script that never loads one back is an export, not a resume point
    export = RESUMING.replace('start = torch.load("run/last.pt", map_location="cpu", weights_only=True)\n',
                              'start = {"epoch": 0}\n')
    assert export != RESUMING and found(export, "checkpoint-missing-state") == []


def test_rng_state_is_advice_when_the_resume_restarts_at_an_epoch_with_an_epoch_seeded_order():
    seeded = RESUMING.replace("    for x in loader:\n", "    sampler.set_epoch(epoch)\n    for x in loader:\n")
    assert found(seeded, "checkpoint-missing-state") == []  # the default output is defects only
    advice = [(f.rule, f.severity) for f in analyze_source("s.py", seeded, advice=True)]
    assert ("checkpoint-missing-state", "advice") in advice
    # saved mid-epoch, a resume repeats batches: still a defect, whatever the order
    mid = seeded.replace("    if rank == 0:\n        torch.save", "        if rank == 0:\n            torch.save")
    mid = mid.replace('        os.replace("run/tmp.pt"', '            os.replace("run/tmp.pt"')
    assert [s for _, _, s in found(mid, "checkpoint-missing-state")] == ["warning"]


# a single-node launcher that joins the group with the process index itself: that index
# is the global rank, though the script also reads a node rank (for its address)
JOINED_WITH_THE_INDEX = """
import datetime, torch
import torch.distributed as dist
import torch.multiprocessing as mp
def run(index, opts):
    opts.rank = index
    print("node", opts.node_rank)
    dist.init_process_group("nccl", "env://", datetime.timedelta(minutes=5), opts.world_size, opts.rank)
    torch.cuda.set_device(index % torch.cuda.device_count())
    if opts.rank == 0:
        torch.save({}, "last.pt.tmp")
mp.spawn(run, nprocs=8, args=(None,))
"""


def test_the_rank_a_script_joins_with_is_global_whatever_it_was_copied_from():
    assert found(JOINED_WITH_THE_INDEX, "unguarded-save") == []
    # the look-alike: the group is joined with another rank, the guard tests the index
    node_local = JOINED_WITH_THE_INDEX.replace("opts.world_size, opts.rank)",
                                               "opts.world_size, opts.node_rank * 8 + index)")
    assert found(node_local, "unguarded-save") == [("unguarded-save", 11, "warning")]
    # a rank attribute set out of view reads as the global rank, a local one as local
    out_of_view = JOINED_WITH_THE_INDEX.replace("    opts.rank = index\n", "")
    assert found(out_of_view, "unguarded-save") == []
    named_local = out_of_view.replace("if opts.rank == 0", "if opts.local_rank == 0")
    assert found(named_local, "unguarded-save") == [("unguarded-save", 10, "warning")]


# a save helper in another file of the program, every call guarded in the caller
SAVE_HELPER = """
import os, torch
def save_state(model, path):
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
"""

GUARDING_CALLER = PRE + """
from ckpt import save_state
def main(model):
    for epoch in range(3):
        if rank == 0:
            save_state(model, f"epoch{epoch}.pt")
    if dist.get_rank() == 0:
        save_state(model, "final.pt")
if __name__ == "__main__":
    main(None)
"""


def test_a_save_guarded_in_every_caller_in_another_file_is_guarded(tmp_path):
    files = {"ckpt.py": SAVE_HELPER, "train.py": GUARDING_CALLER}
    assert found_in(tmp_path, files, "unguarded-save") == []
    # the look-alike: one call site left unguarded; the witness names it
    one_open = GUARDING_CALLER.replace('    if dist.get_rank() == 0:\n        save_state(model, "final.pt")',
                                       '    save_state(model, "final.pt")')
    assert found_in(tmp_path / "open", {**files, "train.py": one_open}, "unguarded-save") == [
        ("ckpt.py", "unguarded-save", 4, "error")]
    _, [f] = analyze_paths([str(tmp_path / "open")], select={"unguarded-save"})
    line = one_open.splitlines().index('    save_state(model, "final.pt")') + 1
    assert f"`save_state()` called at {tmp_path / 'open' / 'train.py'}:{line}" in f.witness
