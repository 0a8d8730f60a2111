"""`disttrain doctor` on the shapes of real public training scripts it used to cry wolf on.

Each snippet reproduces the structure of one public script (pytorch/examples imagenet,
FSDP T5 training, the DDP tutorial series; torchtitan) in a few lines; the test says
what the doctor must (not) report there. The rule-by-rule cases are in test_doctor.py.
"""

from __future__ import annotations

import ast
import textwrap

from disttrain.doctor.analyzer import analyze_paths, analyze_source
from test_doctor import PRE


def findings(source: str, path: str = "script.py"):
    return analyze_source(path, textwrap.dedent(source))


def rules(source: str) -> list[str]:
    return [f.rule for f in findings(source)]


# pytorch/examples imagenet/main.py: DDP when distributed, DataParallel otherwise.
IMAGENET = """
import torch, torch.nn as nn, torch.distributed as dist, datetime
def main_worker(gpu, args):
    if args.distributed:
        dist.init_process_group(backend="nccl", init_method=args.dist_url,
                                timeout=datetime.timedelta(minutes=5))
    model = nn.Linear(2, 2)
    if not torch.cuda.is_available():
        print("using CPU, this will be slow")
    elif args.distributed:
        torch.cuda.set_device(args.gpu)
        model.cuda(args.gpu)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    elif args.gpu is not None:
        torch.cuda.set_device(args.gpu)
        model = model.cuda(args.gpu)
    else:
        if args.arch.startswith("alexnet"):
            model.features = torch.nn.DataParallel(model.features)
            model.cuda(args.gpu)
        else:
            model = torch.nn.DataParallel(model).cuda(args.gpu)
"""


def test_data_parallel_in_the_non_distributed_branch_is_not_ddp():
    assert "data-parallel-in-ddp" not in rules(IMAGENET)


def test_exclusive_branches_do_not_combine_for_two_statement_rules():
    src = PRE + textwrap.dedent("""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    model = nn.Linear(2, 2).cuda()
    if args.ddp:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = FSDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    assert "optimizer-before-wrap" not in rules(src)
    src = PRE + textwrap.dedent("""
    if args.plain:
        inner = nn.DataParallel(model)
    elif args.ddp:
        outer = DDP(inner, device_ids=[local_rank])
    """)
    assert "data-parallel-in-ddp" not in rules(src)
    # the same two statements on one path still meet (under FSDP, which replaces parameters)
    same_path = PRE + "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n" \
        "model = nn.Linear(2, 2).cuda()\nopt = torch.optim.SGD(model.parameters())\nmodel = FSDP(model)\n"
    assert "optimizer-before-wrap" in rules(same_path)


# pytorch/examples distributed/FSDP/T5_training.py: samplers handed to utils.train(...)
T5 = PRE + """
from torch.utils.data import DistributedSampler, DataLoader
from utils.train_utils import train, validation
sampler1 = DistributedSampler(train_dataset, rank=rank, num_replicas=2, shuffle=True)
sampler2 = DistributedSampler(val_dataset, rank=rank, num_replicas=2)
train_kwargs = {"batch_size": 4, "sampler": sampler1}
test_kwargs = {"batch_size": 4, "sampler": sampler2}
train_loader = DataLoader(train_dataset, **train_kwargs)
val_loader = DataLoader(val_dataset, **test_kwargs)
for epoch in range(1, 3):
    train_accuracy = train(model, rank, train_loader, optimizer, epoch, sampler=sampler1)
    curr_val_loss = validation(model, rank, val_loader)
"""


def test_sampler_passed_to_a_function_defined_elsewhere_is_a_warning():
    found = [f for f in findings(T5) if f.rule == "sampler-without-set-epoch"]
    assert [(f.line, f.severity) for f in found] == [(T5.splitlines().index(
        "sampler1 = DistributedSampler(train_dataset, rank=rank, num_replicas=2, shuffle=True)") + 1,
        "warning")]
    assert "train()" in found[0].message and "not defined" in found[0].message


def test_sampler_passed_to_a_function_in_the_file_is_followed():
    calls = T5.replace("from utils.train_utils import train, validation\n", "")
    with_set_epoch = calls + "def train(model, rank, loader, opt, epoch, sampler=None):\n" \
        "    sampler.set_epoch(epoch)\n"
    assert "sampler-without-set-epoch" not in rules(with_set_epoch)
    without = calls + "def train(model, rank, loader, opt, epoch, sampler=None):\n    pass\n"
    found = [f for f in findings(without) if f.rule == "sampler-without-set-epoch"]
    assert [f.severity for f in found] == ["error"]


def test_sampler_followed_into_another_file_given_on_the_command_line(tmp_path):
    (tmp_path / "t5.py").write_text(T5)
    utils = tmp_path / "utils"
    utils.mkdir()
    (utils / "train_utils.py").write_text(
        "def train(model, rank, loader, opt, epoch, sampler=None):\n"
        "    if sampler:\n        sampler.set_epoch(epoch)\n"
        "def validation(model, rank, loader):\n    pass\n")
    _, found = analyze_paths([str(tmp_path)])
    assert [f for f in found if f.rule == "sampler-without-set-epoch"] == []


def test_sampler_given_to_an_iterator_or_a_class_in_the_file_is_still_an_error():
    base = PRE + """
from torch.utils.data import DistributedSampler, DataLoader
from tqdm import tqdm
sampler = DistributedSampler(ds)
loader = DataLoader(ds, sampler=sampler)
"""
    wrapped = base + "for epoch in range(3):\n    for b in tqdm(loader):\n        pass\n"
    trainer = base + "class Trainer:\n    def __init__(self, data):\n        self.data = data\n" \
        "    def run(self):\n        for epoch in range(3):\n            pass\nTrainer(loader).run()\n"
    for src in (wrapped, trainer):
        found = [f for f in findings(src) if f.rule == "sampler-without-set-epoch"]
        assert [f.severity for f in found] == ["error"]


def test_exclusive_helper_on_if_elif_else_chains():
    from disttrain.doctor.facts import Facts
    src = "if a:\n    x = 1\nelif b:\n    y = 2\nelse:\n    z = 3\nw = 4\nif c:\n    v = 5\n"
    facts = Facts.parse("s.py", src)
    stmt = {n.targets[0].id: n for n in facts.nodes if isinstance(n, ast.Assign)}
    assert facts.exclusive(stmt["x"], stmt["y"]) and facts.exclusive(stmt["y"], stmt["z"])
    assert facts.exclusive(stmt["z"], stmt["x"])
    assert not facts.exclusive(stmt["x"], stmt["w"]) and not facts.exclusive(stmt["x"], stmt["v"])
    assert not facts.exclusive(stmt["x"], stmt["x"])


def test_evaluation_sampler_needs_no_set_epoch():
    src = PRE + """
from torch.utils.data import DistributedSampler, DataLoader
eval_sampler = DistributedSampler(ds)
sampler2 = DistributedSampler(val_dataset)
s3 = DistributedSampler(ds)
test_loader = DataLoader(ds, sampler=s3)
for epoch in range(3):
    for b in test_loader:
        pass
"""
    assert "sampler-without-set-epoch" not in rules(src)


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


def test_method_called_only_under_a_local_rank_guard_is_a_multi_node_warning():
    found = [f for f in findings(TORCHRUN_TRAINER) if f.rule in ("unguarded-save", "unguarded-log")]
    assert {(f.rule, f.severity) for f in found} == {("unguarded-save", "warning"),
                                                     ("unguarded-log", "warning")}
    assert all("local rank" in f.message and "node" in f.message for f in found)
    assert all("runs on every rank" not in f.message for f in found)


def test_method_called_only_under_a_global_rank_guard_is_fine():
    src = TORCHRUN_TRAINER.replace('self.gpu_id == 0 and', 'int(os.environ["RANK"]) == 0 and')
    assert [r for r in rules(src) if r in ("unguarded-save", "unguarded-log")] == []


# torchtitan train.py / distributed/utils.py: a logger configured in another module
def test_logger_set_up_elsewhere_or_rank_aware_is_not_flagged():
    imported = PRE + "from torchtitan.tools.logging import logger\nlogger.info('step 1')\n"
    assert "unguarded-log" not in rules(imported)
    for setup in ("logger.addFilter(RankFilter())\n",
                  "logging.basicConfig(format=f'[rank{rank}] %(message)s')\n",
                  "logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)\n"):
        src = PRE + "import logging\nlogger = logging.getLogger(__name__)\n" + setup + \
            "logger.info('step 1')\n"
        assert "unguarded-log" not in rules(src), setup
    plain = PRE + "import logging\nlogging.basicConfig(level=logging.INFO)\nlogger = logging.getLogger(__name__)\n" \
        "logger.info('x')\nprint('y')\n"
    assert rules(plain).count("unguarded-log") == 2
    # nothing configures logging: info() is dropped at the root's default WARNING level
    unconfigured = plain.replace("logging.basicConfig(level=logging.INFO)\n", "")
    assert rules(unconfigured).count("unguarded-log") == 1


def test_fake_backend_needs_no_timeout():
    for backend in ("fake", "local_tensor"):
        src = f"import torch\ntorch.distributed.init_process_group({backend!r}, rank=0, store=store)\n"
        assert "init-without-timeout" not in rules(src)
    assert "init-without-timeout" in rules("import torch\ntorch.distributed.init_process_group('nccl')\n")
