"""After round 5's fixes (issue 26): the open behavioural misses of the held-back reviews,
as small programs modelled on the real code. Each failed on the doctor frozen for round
6's review before these fixes."""

from __future__ import annotations

import ast
import textwrap

from test_doctor_dataflow import PRE, found, found_in  # noqa: F401  (shared helpers)

from disttrain.doctor import control_flow
from disttrain.doctor.analyzer import parse
from disttrain.doctor.dataflow import Project

# audiolm-pytorch's trainers: `and` binds before `or`, so the prompt and the rmtree of
# the shared results folder run on every rank whenever the second part is true
AUDIOLM = """
from shutil import rmtree
from accelerate import Accelerator
class Trainer:
    def __init__(self, folder, force_clear=None):
        self.accelerator = Accelerator()
        self.is_main = self.accelerator.is_main_process
        if self.is_main and force_clear is True or (force_clear is None and input("clear?") == "y"):
            rmtree(folder)
        self.accelerator.wait_for_everyone()
"""


def test_an_or_after_a_rank_test_and_something_runs_on_every_rank():
    assert [f[:2] for f in found(AUDIOLM, "guard-true-on-every-rank")] == [("guard-true-on-every-rank", 8)]
    fixed = AUDIOLM.replace("self.is_main and force_clear is True or (force_clear is None",
                            "self.is_main and (force_clear is True or force_clear is None")
    assert found(fixed, "guard-true-on-every-rank") == []


def test_a_folder_reset_with_no_guard_before_the_barrier_runs_on_every_rank():
    src = AUDIOLM.replace("self.is_main and force_clear is True or ", "force_clear is True or ")
    assert [f[:2] for f in found(src, "guard-true-on-every-rank")] == [("guard-true-on-every-rank", 9)]
    guarded = src.replace("            rmtree(folder)", "            if self.is_main:\n                rmtree(folder)")
    assert found(guarded, "guard-true-on-every-rank") == []


# moco-v3 / simsiam: "single process, or rank 0 of each node" is still a guard
MOCO = PRE + """
def save_checkpoint(state, filename):
    torch.save(state, filename)
def main(args, model):
    if not args.multiprocessing_distributed or (args.multiprocessing_distributed and rank % 8 == 0):
        save_checkpoint({"m": model.state_dict()}, "c.pt")
main(None, None)
"""


def test_single_process_or_rank_zero_stays_a_guard():
    assert found(MOCO, "unguarded-save") == []


# mar: the writer exists on rank 0 only and is passed into another file's function,
# whose `if log_writer is not None:` is then a rank guard
MAR_MAIN = PRE + """
from engine import evaluate
from torch.utils.tensorboard import SummaryWriter
if rank == 0:
    log_writer = SummaryWriter("logs")
else:
    log_writer = None
evaluate("samples", log_writer=log_writer)
"""
MAR_ENGINE = """
import shutil
import torch
def evaluate(folder, log_writer=None):
    if log_writer is not None:
        log_writer.add_scalar("fid", 1.0, 0)
        shutil.rmtree(folder)
    torch.distributed.barrier()
"""


def test_a_rank_only_object_passed_to_another_file_guards_there(tmp_path):
    files = {"main.py": MAR_MAIN, "engine.py": MAR_ENGINE}
    assert found_in(tmp_path, files, "guard-true-on-every-rank") == []
    made_everywhere = MAR_MAIN.replace('if rank == 0:\n    log_writer = SummaryWriter("logs")\nelse:\n    log_writer = None',
                                       'log_writer = SummaryWriter("logs")')
    assert made_everywhere != MAR_MAIN
    everyone = {"main.py": made_everywhere, "engine.py": MAR_ENGINE}
    assert [f[1] for f in found_in(tmp_path, everyone, "guard-true-on-every-rank")] == ["guard-true-on-every-rank"]


def test_is_local_main_process_is_one_process_per_node():
    facts = parse("s.py", textwrap.dedent("""
        if accelerator.is_local_main_process:
            pass
        if accelerator.is_main_process:
            pass
        """))
    facts.others = []
    facts.__dict__["project"] = Project([facts])
    tests = [n.test for n in ast.walk(facts.tree) if isinstance(n, ast.If)]
    assert [control_flow.guard_kind(facts, t) for t in tests] == ["local", "global"]


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


def test_save_pretrained_into_the_final_folder_is_not_atomic():
    assert [f[:2] for f in found(HF_SAVE, "non-atomic-save")] == [("non-atomic-save", 14)]
    aside = HF_SAVE.replace("model.save_pretrained(out_dir)", "model.save_pretrained(out_dir + '.tmp')\n"
                            "        os.replace(out_dir + '.tmp', out_dir)")
    assert found(aside, "non-atomic-save") == []


# ----- round 6's causes, fixed after its figures were recorded -------------------------

# ml-4m: the print override is installed by a helper of a package whose __init__ (the
# re-export) is not among the files: `import fourm.utils as utils` reaches
# fourm/utils/dist.py all the same
ML4M_DIST = """
import builtins, os
import torch
def setup_for_distributed(is_main):
    builtin_print = builtins.print
    def print(*args, **kwargs):
        if is_main or kwargs.pop("force", False):
            builtin_print(*args, **kwargs)
    builtins.print = print
def init_distributed_mode(args):
    args.gpu = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.gpu)
    torch.distributed.init_process_group("nccl", timeout=__import__("datetime").timedelta(minutes=5))
    setup_for_distributed(int(os.environ["RANK"]) == 0)
"""
ML4M_MAIN = """
import fourm.utils as utils
def main(args):
    utils.init_distributed_mode(args)
    print("Creating model")
if __name__ == "__main__":
    main(None)
"""


def test_a_helper_reached_through_a_package_without_its_init_is_seen(tmp_path):
    files = {"run.py": ML4M_MAIN, "fourm/utils/dist.py": ML4M_DIST}
    assert found_in(tmp_path, files, "unguarded-log") == []
    def links(main_source: str) -> bool:
        run = parse("pkg/run.py", textwrap.dedent(main_source))
        dist = parse("pkg/fourm/utils/dist.py", textwrap.dedent(ML4M_DIST))
        return id(dist) in Project([run, dist]).imports[id(run)]
    assert links(ML4M_MAIN)
    # a package that only shares the folder's last name is no link: `import torch.utils`
    assert not links(ML4M_MAIN.replace("fourm.utils", "torch.utils"))


# ml-4m: safetensors' own `torch` module is not torch
SAFETENSORS = PRE + """
from safetensors.torch import load as load_st
with open("m.safetensors", "rb") as f:
    tensors = load_st(f.read())
"""


def test_safetensors_load_is_not_torch_load():
    assert found(SAFETENSORS, "load-without-weights-only") == []
    assert found(SAFETENSORS, "load-without-map-location") == []
    plain = SAFETENSORS.replace("from safetensors.torch import load as load_st", "from torch import load as load_st")
    assert [f[0] for f in found(plain, "load-without-weights-only")] == ["load-without-weights-only"]


# diffusers (round 4): accelerator.save_state on the main process only, a collective
# under DeepSpeed or FSDP; the Trainer's save_state (a JSON of its state) is none
DIFFUSERS = """
from accelerate import Accelerator
from accelerate.utils import DistributedType
accelerator = Accelerator()
for step in range(10):
    if accelerator.is_main_process:
        accelerator.save_state(f"checkpoint-{step}")
        trainer.save_state()
zero3 = accelerator.state.deepspeed_plugin is not None  # the script supports DeepSpeed
"""


def test_accelerate_save_state_on_the_main_process_only_is_a_warning():
    assert [f[:3] for f in found(DIFFUSERS, "collective-under-rank-guard")] == [
        ("collective-under-rank-guard", 7, "warning")]
    balanced = DIFFUSERS.replace("if accelerator.is_main_process:", "if accelerator.is_main_process or "
                                 "accelerator.distributed_type == DistributedType.DEEPSPEED:")
    assert found(balanced, "collective-under-rank-guard") == []


# ml-4m: `timedelta(4800)` meant as seconds is 4800 days; gpt-neox: DeepSpeed's init with
# no timeout starts the same process group
TIMEOUTS = """
import datetime, deepspeed, torch
torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(4800))
deepspeed.init_distributed(dist_backend="nccl", verbose=True)
torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(seconds=4800))
deepspeed.init_distributed(dist_backend="nccl", timeout=datetime.timedelta(minutes=10))
"""


def test_a_timeout_of_days_or_none_given_to_deepspeed_is_reported():
    assert [f[:2] for f in found(TIMEOUTS, "init-without-timeout")] == [
        ("init-without-timeout", 3), ("init-without-timeout", 4)]
