"""Helpers for the rule tests: run the doctor on a script held in a string (or on a few
files written to a temporary folder) and list what it reports.

PRE is the head of a torchrun script that is right in every respect a test does not
touch: the device is bound and the process group has a timeout.
"""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_paths, analyze_source

PRE = """
import datetime, math, os, sys
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
rank = dist.get_rank()
"""

PRE_FSDP2 = ("import datetime, torch, torch.distributed as dist\n"
             "from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n"
             "dist.init_process_group('nccl', timeout=datetime.timedelta(minutes=5))\n")


def found(source: str, rule: str | None = None) -> list[tuple[str, int, str]]:
    """(rule, line, severity) of each finding on `source`, of `rule` only when given."""
    out = [(f.rule, f.line, f.severity) for f in analyze_source("s.py", textwrap.dedent(source))]
    return [x for x in out if rule is None or x[0] == rule]


def found_in(tmp_path, files: dict[str, str], rule: str | None = None) -> list[tuple[str, str, int, str]]:
    """Write `files` (name -> text) under tmp_path, check them as one program: (file name,
    rule, line, severity) of each finding, of `rule` only when given."""
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    _, fs = analyze_paths([str(tmp_path)])
    out = [(str(f.file).rsplit("/", 1)[-1], f.rule, f.line, f.severity) for f in fs]
    return [x for x in out if rule is None or x[1] == rule]


def findings(source: str, path: str = "script.py"):
    return analyze_source(path, textwrap.dedent(source))


def rules(source: str) -> list[str]:
    """The rule of each finding on `source`, in order."""
    return [f.rule for f in findings(source)]


def rule_severities(source: str) -> list[tuple[str, str]]:
    return [(f.rule, f.severity) for f in analyze_source("s.py", source)]


# A program where FSDP is a mode (`if args.fsdp:`) and the DDP path shares the
# checkpoint code (the shape of open_lm's main.py).
FSDP_AS_A_MODE = PRE + textwrap.dedent("""
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
def main(args):
    model = nn.Linear(2, 2).cuda()
    if args.fsdp:
        model = FSDP(model)
    else:
        model = DDP(model, device_ids=[local_rank])
    if args.amp:
        assert not args.fsdp, "amp runs on the DDP path only"
        scaler = torch.cuda.amp.GradScaler()
    keep(args, model)
def keep(args, model):
    full = None
    if args.fsdp:
        full = model.state_dict()
    if args.writes:
        torch.save({"weights": full if args.fsdp else model.state_dict()}, "w.pt.tmp")
args.writes = rank == 0
main(args)
""")

# An Accelerate trainer (the shape of F5-TTS's): accelerator.save is torch.save, and
# even_batches is turned off.
ACCELERATE_TRAINER = """
import os
from accelerate import Accelerator
class Trainer:
    def __init__(self):
        self.accelerator = Accelerator()
    def keep(self, state, folder):
        if self.accelerator.is_main_process:
            self.accelerator.save(state, f"{folder}/last.pt")
    def train(self, loader):
        self.accelerator.even_batches = False
        for batch in loader:
            self.accelerator.backward(self.model(batch))
"""

# A project's own distributed helpers (the pattern many vision repositories share): a
# set-up that binds the device and silences print() off rank 0, and a save that only
# rank 0 performs.
RANK_ZERO_HELPERS = """
import builtins, datetime, os
import torch
import torch.distributed as dist

def quiet_unless(loud):
    original = builtins.print
    def gated(*parts, **options):
        if options.pop("always", False) or loud:
            original(*parts, **options)
    builtins.print = gated

def start_from_env(cfg):
    cfg.rank = int(os.environ["RANK"])
    cfg.device_index = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(cfg.device_index)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    quiet_unless(cfg.rank == 0)

def first_rank():
    return dist.get_rank() == 0

def save_from_rank_zero(*parts, **options):
    if first_rank():
        torch.save(*parts, **options)
"""
