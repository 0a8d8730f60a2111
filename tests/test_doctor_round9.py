"""Round 8's causes (issue 26), fixed after its figures were recorded: each a small
program modelled on the held-back project where it was found. Each failed on the doctor
frozen for round 8's review (commit 3542bd6)."""

from __future__ import annotations

from test_doctor_dataflow import PRE, found, found_in  # noqa: F401  (shared helpers)

# ----- false findings ------------------------------------------------------------------

# OLMo-core: each rank reads back its own trainer state, named in a for loop
OLMO_LOAD = PRE + """
for path in (f"{d}/train/rank{dist.get_rank()}.pt", f"{d}/train/rank0.pt"):
    try:
        state = torch.load(path, weights_only=False)
        break
    except FileNotFoundError:
        pass
"""


def test_a_per_rank_file_named_by_a_loop_needs_no_map_location():
    assert found(OLMO_LOAD, "load-without-map-location") == []


# ddim: one process driving every GPU through DataParallel
DDIM = """
import torch
model = torch.nn.DataParallel(Model().to("cuda"))
states = torch.load("ckpt.pth")
"""


def test_a_single_process_data_parallel_script_needs_no_map_location():
    assert found(DDIM, "load-without-map-location") == []


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


def test_a_save_into_a_temporary_working_directory_is_atomic():
    assert found(OLMO_SAVE, "non-atomic-save") == []
    direct = OLMO_SAVE.replace("with self._temporary_wd(d) as wd:", "with self._open_dir(d) as wd:")
    assert found(direct, "non-atomic-save") != []


# jukebox: a debug dump of sampled data just before the process exits
DUMP = PRE + """
def save_outputs(data):
    torch.save(data, "data.pth.tar")
    dist.barrier()
    exit()
save_outputs(None)
"""


def test_a_dump_right_before_exit_is_no_checkpoint():
    assert found(DUMP, "non-atomic-save") == []


# jukebox: the print in the branch where torch.distributed is not available
JUKEBOX_PRINT = PRE + """
def print_all(msg):
    if not dist.is_available():
        print(msg)
    elif dist.get_rank() % 8 == 0:
        print(f"{dist.get_rank() // 8}: {msg}")
def setup():
    if dist.is_available():
        return 1
    else:
        print("Using cuda")
print_all("x")
setup()
if torch.cuda.is_available():
    pass
else:
    print("no cuda")
"""


def test_the_branch_without_torch_distributed_is_one_process():
    assert [f[1] for f in found(JUKEBOX_PRINT, "unguarded-log")] == [27]  # torch.cuda's is no such test


# jukebox: its own adapter's init_process_group takes no timeout; the torch call inside is judged
ADAPTER = """
import torch.distributed as dist
def init_process_group(backend, init_method):
    return dist.init_process_group(backend, init_method)
"""
JUKEBOX_SETUP = """
import os, torch
import adapter as dist
def setup():
    torch.cuda.set_device(0)
    dist.init_process_group(backend="nccl", init_method="env://")
setup()
"""


def test_a_call_of_the_projects_own_init_wrapper_is_judged_at_its_torch_call(tmp_path):
    got = found_in(tmp_path, {"adapter.py": ADAPTER, "train.py": JUKEBOX_SETUP}, "init-without-timeout")
    assert [(f[0], f[2]) for f in got] == [("adapter.py", 4)]


# KAIR, Stark: the entry script in view binds the device, then reaches the trainer through
# an import out of view or importlib
STARK_RUN = """
import importlib, torch, torch.distributed as dist
def main(local_rank):
    dist.init_process_group(backend="nccl", timeout=t)
    torch.cuda.set_device(local_rank)
    importlib.import_module("lib.train.train_script").run()
if __name__ == "__main__":
    main(0)
"""
STARK_SCRIPT = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
def run(settings):
    net = build()
    net.cuda()
    net = DDP(net, device_ids=[settings.local_rank])
"""


def test_an_entry_script_in_view_that_binds_the_device_covers_the_trainer(tmp_path):
    got = found_in(tmp_path, {"run_training.py": STARK_RUN, "train_script.py": STARK_SCRIPT}, "missing-set-device")
    assert got == []


# ----- misses --------------------------------------------------------------------------

# KAIR: **kwargs forwarded twice before init_process_group, and no caller passes a timeout
KAIR_DIST = """
import os, torch, torch.distributed as dist
def init_dist(launcher, backend="nccl", **kwargs):
    if launcher == "pytorch":
        _init_dist_pytorch(backend, **kwargs)
def _init_dist_pytorch(backend, **kwargs):
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, **kwargs)
init_dist("pytorch")
"""


def test_a_timeout_forwarded_through_two_helpers_by_no_caller_is_none():
    assert [f[1] for f in found(KAIR_DIST, "init-without-timeout")] == [8]
    passed = KAIR_DIST.replace('init_dist("pytorch")', 'init_dist("pytorch", timeout=t)')
    assert found(passed, "init-without-timeout") == []


# DeepLearningExamples: the checkpoint is copied onto the last-checkpoint name in place
DLE = PRE + """
import shutil
def save_checkpoint(state, full_path, last_path):
    torch.save(state, full_path)
    shutil.copyfile(full_path, last_path)
if rank == 0:
    save_checkpoint({}, "checkpoint_0001.pth.tar", "checkpoint.pth.tar")
"""


def test_a_copy_of_a_checkpoint_onto_another_name_is_not_atomic():
    assert [f[1] for f in found(DLE, "non-atomic-save")] == [14, 15]
    aside = DLE.replace("shutil.copyfile(full_path, last_path)", "shutil.copyfile(full_path, last_path + '.tmp')")
    assert [f[1] for f in found(aside, "non-atomic-save")] == [14]
