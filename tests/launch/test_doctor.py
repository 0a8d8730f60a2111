"""`disttrain doctor`: every rule fires on its pitfall and stays silent on the fix.

Each CASES entry is (rule id, a script that shows the pitfall, the same script done
right). The clean script in doctor_samples/ and everything under examples/ must give
zero findings: a false positive is a bug. Output formats, exit codes, suppression
comments and the CLI's error path are in test_doctor_report.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from doctor_cases import new_cases

from disttrain.doctor import main
from disttrain.doctor.analyzer import analyze_paths, analyze_source
from disttrain.doctor.findings import RULES

HERE = Path(__file__).parents[1]
SAMPLES = HERE / "doctor_samples"
REPO = HERE.parent

# Shared preamble of a torchrun script that is correct in every respect the cases
# below do not touch: device bound, process group with a timeout.
PRE = """
import datetime, os
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
rank = dist.get_rank()
"""

CASES = [
    ("data-parallel",
     "import torch.nn as nn\nmodel = nn.DataParallel(nn.Linear(2, 2).cuda())\n",
     "import torch.nn as nn\nmodel = nn.Linear(2, 2).cuda()\n"),
    ("data-parallel-in-ddp",
     PRE + "model = DDP(nn.DataParallel(nn.Linear(2, 2).cuda()), device_ids=[local_rank])\n",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"),
    ("optimizer-before-wrap",  # FSDP replaces the parameters (DDP keeps them: no finding)
     PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
           "model = nn.Linear(2, 2).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
           "model = FSDP(model)\n",
     PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
           "model = nn.Linear(2, 2).cuda()\nmodel = FSDP(model)\n"
           "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"),
    ("missing-set-device",
     "import os, torch, datetime\nimport torch.distributed as dist\n"
     "dist.init_process_group('nccl', timeout=datetime.timedelta(minutes=5))\n"
     "x = torch.zeros(3).cuda()\n",
     "import os, torch, datetime\nimport torch.distributed as dist\n"
     "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
     "dist.init_process_group('nccl', timeout=datetime.timedelta(minutes=5))\n"
     "x = torch.zeros(3).cuda()\n"),
    ("sampler-without-set-epoch",
     PRE + "from torch.utils.data import DistributedSampler, DataLoader\n"
           "s = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=s)\n"
           "for epoch in range(3):\n    for b in loader:\n        pass\n",
     PRE + "from torch.utils.data import DistributedSampler, DataLoader\n"
           "s = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=s)\n"
           "for epoch in range(3):\n    s.set_epoch(epoch)\n    for b in loader:\n        pass\n"),
    ("ddp-state-dict-prefix",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"
           "if rank == 0:\n    torch.save(model.state_dict(), 'w.pt.tmp')\n    os.replace('w.pt.tmp', 'w.pt')\n",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"
           "if rank == 0:\n    torch.save(model.module.state_dict(), 'w.pt.tmp')\n"
           "    os.replace('w.pt.tmp', 'w.pt')\n"),
    ("unguarded-save",
     PRE + "torch.save({'step': 1}, 'c.tmp')\nos.replace('c.tmp', 'c.pt')\n",
     PRE + "if rank == 0:\n    torch.save({'step': 1}, 'c.tmp')\n    os.replace('c.tmp', 'c.pt')\n"),
    ("unguarded-log",
     PRE + "import logging\nlogger = logging.getLogger('x')\nprint('start')\nlogger.info('go')\n",
     PRE + "import logging, sys\nlogger = logging.getLogger('x')\nif rank == 0:\n    print('start')\n"
           "    logger.info('go')\nlogger.warning('every rank may warn')\nprint('oops', file=sys.stderr)\n"),
    ("non-atomic-save",
     "import torch\ntorch.save({'w': 1}, 'ckpt.pt')\n",
     "import os, torch\ntorch.save({'w': 1}, 'ckpt.pt.tmp')\nos.replace('ckpt.pt.tmp', 'ckpt.pt')\n"),
    ("loss-divided-twice",
     PRE + "accum_steps = 4\nfor x in data:\n    loss = model(x).sum() / accum_steps\n"
           "    (loss / accum_steps).backward()\n",
     PRE + "accum_steps = 4\nfor x in data:\n    loss = model(x).sum() / accum_steps\n    loss.backward()\n"),
    ("accumulation-without-no-sync",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"
           "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\naccum = 4\n"
           "for i, x in enumerate(data):\n    (model(x).sum() / accum).backward()\n"
           "    if (i + 1) % accum == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n",
     PRE + "import contextlib\nmodel = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"
           "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\naccum = 4\n"
           "for i, x in enumerate(data):\n    boundary = (i + 1) % accum == 0\n"
           "    with (contextlib.nullcontext() if boundary else model.no_sync()):\n"
           "        (model(x).sum() / accum).backward()\n"
           "    if boundary:\n        optimizer.step()\n        optimizer.zero_grad()\n"),
    ("accumulation-off-by-one",
     PRE + "accum = 4\nfor i, x in enumerate(data):\n    (model(x).sum() / accum).backward()\n"
           "    if i % accum == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n",
     PRE + "accum = 4\nfor i, x in enumerate(data):\n    (model(x).sum() / accum).backward()\n"
           "    if (i + 1) % accum == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n"),
    ("find-unused-parameters",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank], find_unused_parameters=True)\n",
     PRE + "class Gate(nn.Module):\n    def forward(self, x):\n        if x.sum() > 0:\n"
           "            return self.a(x)\n        return self.b(x)\n"
           "model = DDP(Gate().cuda(), device_ids=[local_rank], find_unused_parameters=True)\n"),
    ("init-without-timeout",
     "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
     "import datetime\nimport torch.distributed as dist\n"
     "dist.init_process_group('gloo', timeout=datetime.timedelta(minutes=5))\n"),
    ("hardcoded-master-port",
     "import os\nos.environ['MASTER_PORT'] = '12355'\n",
     "import os\nport = os.environ['MASTER_PORT']\n"),
    ("mp-spawn",
     "import torch.multiprocessing as mp\ndef worker(rank):\n    pass\nmp.spawn(worker, nprocs=2)\n",
     "import os\ndef worker(rank):\n    pass\nworker(int(os.environ['RANK']))\n"),
    ("gradscaler-unsynced",
     PRE + "scaler = torch.amp.GradScaler('cuda')\nfor x in data:\n    loss = model(x)\n"
           "    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n    for p in model.parameters():\n"
           "        dist.all_reduce(p.grad)\n    scaler.step(opt)\n    scaler.update()\n",
     PRE + "model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])\n"
           "scaler = torch.amp.GradScaler('cuda')\nfor x in data:\n    loss = model(x).sum()\n"
           "    scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()\n"),
    ("load-without-map-location",
     "import torch\nsd = torch.load('w.pt', weights_only=True)\n",
     "import torch\nsd = torch.load('w.pt', map_location='cpu', weights_only=True)\n"),
    ("load-without-weights-only",
     "import torch\nsd = torch.load('w.pt', map_location='cpu', weights_only=False)\n",
     "import torch\nsd = torch.load('w.pt', map_location='cpu', weights_only=True)\n"),
    ("collective-under-rank-guard",
     PRE + "if rank == 0:\n    torch.save({}, 'c.pt.tmp')\nelse:\n    dist.barrier()\n",
     PRE + "if rank != 0:\n    dist.barrier()\nprepare()\nif rank == 0:\n    dist.barrier()\n"
           "if args.local_rank != -1:\n    dist.all_reduce(t)\n"),
    ("eval-gather-padded",
     PRE + "from torch.utils.data import DataLoader, DistributedSampler\n"
           "loader = DataLoader(val_set, sampler=DistributedSampler(val_set, shuffle=False))\n"
           "def evaluate():\n    preds = [model(x) for x in loader]\n    for x in loader:\n        pass\n"
           "    out = [None] * 2\n    dist.all_gather_object(out, preds)\n",
     PRE + "from torch.utils.data import DataLoader, DistributedSampler\n"
           "loader = DataLoader(val_set, sampler=DistributedSampler(val_set, shuffle=False))\n"
           "def evaluate():\n    preds = [model(x) for x in loader]\n    for x in loader:\n        pass\n"
           "    out = [None] * 2\n    dist.all_gather_object(out, preds)\n    return out[:len(val_set)]\n"),
    ("fsdp2-no-sync",
     PRE + "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
           "with model.no_sync():\n    model(x).sum().backward()\n",
     PRE + "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
           "model.set_requires_gradient_sync(False)\nmodel(x).sum().backward()\n"),
    ("fsdp2-fp16-without-scaler",
     PRE + "from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n"
           "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))\n",
     PRE + "from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n"
           "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))\n"
           "scaler = torch.amp.GradScaler('cuda')\n"),
    ("checkpoint-missing-state",
     PRE + "sd = torch.load('c.pt', map_location='cpu', weights_only=True)\n"
           "for x in loader:\n    torch.save({'model': m.state_dict(), 'optimizer': opt.state_dict()}, p)\n",
     PRE + "sd = torch.load('c.pt', map_location='cpu', weights_only=True)\n"
           "for x in loader:\n    torch.save({'model': m.state_dict(), 'optimizer': opt.state_dict(),\n"
           "                'rng': torch.get_rng_state(), 'sampler': sampler.state_dict()}, p)\n"),
    ("fsdp1-clip-grad",
     PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
           "model = FSDP(nn.Linear(2, 2).cuda())\nopt = torch.optim.AdamW(model.parameters())\n"
           "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
     PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
           "model = FSDP(nn.Linear(2, 2).cuda())\nopt = torch.optim.AdamW(model.parameters())\n"
           "model.clip_grad_norm_(1.0)\n"),
] + new_cases(PRE)


def rules_of(source: str, path: str = "script.py") -> list[str]:
    """Every rule that fires, advice included (a rule's case holds for an advice rule too)."""
    return [f.rule for f in analyze_source(path, textwrap.dedent(source), advice=True)]


def test_every_rule_has_a_case():
    assert {c[0] for c in CASES} == set(RULES)


@pytest.mark.parametrize("rule,bad,good", CASES, ids=[c[0] for c in CASES])
def test_rule_fires_on_pitfall_and_not_on_fix(rule, bad, good):
    assert rule in rules_of(bad), f"{rule} missed its pitfall"
    assert rule not in rules_of(good), f"{rule} fired on the fixed script"


@pytest.mark.parametrize("rule,bad,good", CASES, ids=[c[0] for c in CASES])
def test_ignore_comment_suppresses_only_that_rule(rule, bad, good):
    hit_lines = {f.line for f in analyze_source("s.py", bad, advice=True) if f.rule == rule}

    def commented(comment: str) -> str:
        lines = bad.splitlines()
        for n in hit_lines:
            lines[n - 1] += f"  # disttrain: {comment}"
        return "\n".join(lines) + "\n"

    assert rule not in rules_of(commented(f"ignore[{rule}]"))
    assert rule not in rules_of(commented(f"ignore[some-other-rule, {rule}]"))
    assert rule in rules_of(commented("ignore[some-other-rule]"))


# ----- false positives: correct patterns that must stay silent ----------------------

SILENT = {
    "rank guard in a helper called only under a guard": PRE + """
def save(obj, path):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)
    print("saved", path)
if rank == 0:
    save({}, "c.pt")
""",
    "early-exit guard": PRE + """
def log_and_save(obj):
    if rank != 0:
        return
    print("saving")
    torch.save(obj, "c.tmp")
    os.replace("c.tmp", "c.pt")
""",
    "rank-zero-only decorator and is_main attribute": PRE + """
@rank_zero_only
def report(msg):
    print(msg)
if info.is_main:
    print("hello")
""",
    "per-rank checkpoint file": PRE + """
torch.save({}, f"shard_rank{rank}.tmp")
os.replace(f"shard_rank{rank}.tmp", f"shard_rank{rank}.pt")
""",
    "in-memory buffer": PRE + "import io\nbuf = io.BytesIO()\ntorch.save({}, buf)\n",
    "set_device in a setup() helper defined below": """
import os, datetime, torch
import torch.distributed as dist
def main():
    setup()
    x = torch.zeros(1).cuda()
def setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
""",
    "device string compared, not used": PRE + "if x.device.type == 'cuda':\n    pass\n",
    "single-process script prints freely": "import torch\nprint(torch.zeros(2))\n",
    "DistributedSampler without shuffle": PRE + """
from torch.utils.data import DistributedSampler
s = DistributedSampler(ds, shuffle=False)
for epoch in range(3):
    for b in ds:
        pass
""",
    "train_loader.sampler.set_epoch": PRE + """
from torch.utils.data import DistributedSampler, DataLoader
loader = DataLoader(ds, sampler=DistributedSampler(ds))
for epoch in range(3):
    loader.sampler.set_epoch(epoch)
""",
    "str.replace is not mistaken for an atomic move, but Path.replace is": """
import torch
from pathlib import Path
tmp = Path("c.pt.tmp")
torch.save({}, tmp)
tmp.replace("c.pt")
""",
    "disttrain API": """
import torch
import disttrain as dt
with dt.distributed(seed=0) as info:
    model = dt.wrap(torch.nn.Linear(2, 2).to(info.device))
    optimizer = torch.optim.AdamW(model.parameters())
    sampler = dt.DistributedSampler(1000)
    for epoch in range(3):
        for i in sampler:
            pass
    dt.print_main("done")
    if info.is_main:
        dt.atomic_torch_save({"model": dt.unwrap(model).state_dict()}, "c.pt")
""",
    "unwrap chosen by hasattr(model, 'module')": PRE + """
model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])
if rank == 0:
    sd = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
    torch.save(sd, "w.tmp")
    os.replace("w.tmp", "w.pt")
""",
    "indexed devices and a process group bound with device_id": """
import os, datetime, torch
import torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local_rank}")
dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
x = torch.zeros(1, device=device)
""",
    "loss divided once in each branch": PRE + """
accum_steps = 4
for i, x in enumerate(data):
    if i % accum_steps:
        loss = model(x).sum() / accum_steps
        loss.backward()
    else:
        loss = model(x).sum() / accum_steps
        loss.backward()
""",
    "accumulation counted from 1, or a window zeroed at its first micro-batch": PRE + """
accum = 4
for i, x in enumerate(data, start=1):
    (model(x).sum() / accum).backward()
    if i % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
for i, x in enumerate(data):
    if i % accum == 0:
        optimizer.zero_grad()
    (model(x).sum() / accum).backward()
    if i % accum == accum - 1:
        optimizer.step()
for i, x in enumerate(data):
    if i % 100 == 0:
        evaluate(model)
    model(x).sum().backward()
    optimizer.step()
""",
    "optimizer rebuilt after the wrap": PRE + """
model = nn.Linear(2, 2).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
""",
}


@pytest.mark.parametrize("source", SILENT.values(), ids=SILENT.keys())
def test_correct_patterns_stay_silent(source):
    assert rules_of(source) == []


def test_clean_ddp_script_has_zero_findings():
    files, findings = analyze_paths([str(SAMPLES / "clean_ddp.py")])
    assert [f.to_dict() for f in findings] == []
    assert main([str(SAMPLES / "clean_ddp.py")]) == 0


BEFORE_CONVERSION = "gpt_torchrun.py"
"""The plain script of examples/ kept as the "before" of a conversion to `dt.Job`: it
holds the habits of a hand-written loop on purpose, and the doctor names them."""


def test_examples_directory_has_zero_findings_but_the_script_before_its_conversion():
    examples = REPO / "examples"
    if not examples.is_dir() or not list(examples.rglob("*.py")):
        pytest.skip("examples/ holds no Python scripts yet")
    _, findings = analyze_paths([str(examples)])
    assert [f"{f.file}:{f.line} {f.rule}: {f.message}" for f in findings
            if Path(f.file).name != BEFORE_CONVERSION] == []
    before = {f.rule for f in findings if Path(f.file).name == BEFORE_CONVERSION}
    # what the conversion takes away: each one a warning, none an error
    assert before == {"unguarded-log", "init-without-timeout", "load-without-weights-only", "non-atomic-save"}
    assert all(f.severity == "warning" for f in findings)
    # its epoch-end checkpoint has no RNG state, but the order is epoch-seeded: advice only
    _, advised = analyze_paths([str(examples)], advice=True)
    assert {(f.rule, f.severity) for f in advised if f not in findings} == {("checkpoint-missing-state", "advice")}


OFF_BY_ONE = {  # other spellings of "the step index % N is 0" around an optimizer step
    "else of != 0, with no_sync": "if step % accum != 0:\n        with model.no_sync():\n"
                                  "            loss.backward()\n    else:\n        loss.backward()\n"
                                  "        scaler.step(optimizer)\n",
    "not step % N, or the last batch": "loss.backward()\n"
                                       "    if not step % accum or step == len(data) - 1:\n"
                                       "        self.optimizer.step()\n",
}


@pytest.mark.parametrize("body", OFF_BY_ONE.values(), ids=OFF_BY_ONE.keys())
def test_accumulation_off_by_one_in_its_other_spellings(body):
    src = PRE + f"accum = 4\nfor step, x in enumerate(data):\n    loss = model(x).sum() / accum\n    {body}"
    assert rules_of(src) == ["accumulation-off-by-one"]
    [f] = analyze_source("s.py", src)
    assert "`step % accum` is 0" in f.message and f.fix.startswith("test `(step + 1) % accum == 0`")
    # the same loop with the index rebound (a 1-based counter made from it) is not judged
    assert rules_of(src.replace("    loss = ", "    step = step + 1\n    loss = ")) == []
