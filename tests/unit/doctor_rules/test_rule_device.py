"""missing-set-device, collective-before-set-device: binding each process to its GPU.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import found, found_in, rule_severities

CUDA_TRAINER = """
import torch, torch.distributed
def start_group():
    torch.distributed.init_process_group("nccl")
class Trainer:
    def train(self):
        probe = torch.ones(1).cuda()
"""

# efficientvit (round 5): the entry script calls `setup.setup_dist_env(args.gpu)`, out of
# view, and the trainer in view uses CUDA: what the doctor could not see is a warning
OUT_OF_VIEW_SETUP_ENTRY = """
from vendor.apps import setup
from trainer import Trainer
def main(opts):
    setup.setup_dist_env(opts.gpu)
    Trainer().train()
if __name__ == "__main__":
    main(None)
"""

# KAIR, Stark: the entry script in view binds the device, then reaches the trainer through
# an import out of view or importlib
BINDING_ENTRY = """
import importlib, torch, torch.distributed as dist
def main(local_rank):
    dist.init_process_group("nccl", timeout=t)
    torch.cuda.set_device(local_rank)
    importlib.import_module("pkg.loops.train_script").run()
if __name__ == "__main__":
    main(0)
"""

IMPORTED_LOOP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
def run(opts):
    net = make_net()
    net.cuda()
    net = DDP(net, device_ids=[opts.local_rank])
"""

# CodeT5's configs.py: the single-process branch names "cuda", the distributed one binds
# the device first; the two never run together
BIND_IN_ONE_BRANCH = """
import torch
def choose_device(opts):
    if opts.local_rank < 0 or opts.cpu_only:
        where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        opts.n_gpu = torch.cuda.device_count()
    else:
        torch.cuda.set_device(opts.local_rank)
        where = torch.device("cuda", opts.local_rank)
        torch.distributed.init_process_group("nccl", timeout=t)
        opts.n_gpu = 1
    opts.device = where
choose_device(None)
"""

# demucs: dora's distrib.init (out of view) binds each rank's device, then starts the group
DORA_INIT = """
import torch
from torch.nn.parallel.distributed import DistributedDataParallel
from dora import distrib as dora_distrib
me, size = 0, 1
def start():
    global me, size
    if not torch.distributed.is_initialized():
        dora_distrib.init()
    me = dora_distrib.rank()
    size = dora_distrib.world_size()
def mean_of(values):
    total = torch.tensor([*values, 1.0], device='cuda')
    torch.distributed.all_reduce(total)
    return total
def wrapped(net):
    if size == 1:
        return net
    here = torch.cuda.current_device()
    return DistributedDataParallel(net, device_ids=[here], output_device=here)
start()
"""


def test_a_device_named_with_its_index_before_set_device_is_no_cuda_use():
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    x = torch.zeros(2).cuda()
    """)
    assert found(src, "missing-set-device") == []


def test_a_cuda_use_on_a_path_that_returns_before_the_group_starts_is_no_rank_s():
    # SparK's dist.initialize: without RANK it takes one GPU and returns before set_device
    src = textwrap.dedent("""
    import os, datetime, torch
    import torch.distributed as tdist
    def start():
        if not torch.cuda.is_available():
            return
        elif 'RANK' not in os.environ:
            only = torch.ones(1).cuda().device
            return
        local_rank = int(os.environ['RANK']) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        tdist.init_process_group('nccl', timeout=datetime.timedelta(minutes=5))
    """)
    assert found(src, "missing-set-device") == []
    # a use before the bind on the path that goes on to start the group is still one
    on_path = src.replace("    local_rank = int(", "    x = torch.zeros(1).cuda()\n    local_rank = int(")
    assert found(on_path, "missing-set-device") == [("missing-set-device", 10, "error")]


def test_an_accelerator_binds_the_device(tmp_path):
    # PixArt-alpha: train.py builds an Accelerator; its dist_utils helper uses "cuda"
    files = {
        "train.py": "import torch\nfrom accelerate import Accelerator\nfrom dist_utils import all_gather\n"
                    "accelerator = Accelerator()\nall_gather(1)\n",
        "dist_utils.py": "import os, torch\nimport torch.distributed as dist\n"
                         "def node_index():\n    return int(os.getenv('LOCAL_RANK', 0))\n"
                         "def all_gather(value):\n    t = torch.ones(1).to(torch.device('cuda'))\n"
                         "    got = [t]\n    dist.all_gather(got, t)\n    return got\n"}
    assert found_in(tmp_path, files, "missing-set-device") == []


def test_an_init_helper_named_for_the_device_binds_it():
    # efficientdet: timm's `utils.init_distributed_device(args)` calls torch.cuda.set_device
    src = textwrap.dedent("""
    import os, torch
    from timm import utils
    def main(opts):
        opts.distributed = int(os.environ.get('WORLD_SIZE', 1)) > 1
        where = utils.init_distributed_device(opts)
        net = torch.nn.Linear(2, 2)
        net.cuda()
        if opts.distributed:
            net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[opts.device])
    """)
    assert found(src, "missing-set-device") == []


def test_cuda_in_a_file_whose_program_is_entered_out_of_view_is_a_warning(tmp_path):
    # efficientvit: the trainer and dist helpers are checked, the script that calls
    # setup.setup_dist_env (which binds the device) is not: no entry point in view
    files = {
        "base.py": "import torch\nfrom dist import first, node_index\nclass Trainer:\n"
                   "    def __init__(self, net):\n        self.net = net.cuda()\n"
                   "    def prep(self):\n        self.net = torch.nn.parallel.DistributedDataParallel(\n"
                   "            self.net, device_ids=[node_index()])\n",
        "dist.py": "import os, torch, torch.distributed\n"
                   "def start_group():\n    torch.distributed.init_process_group('nccl')\n"
                   "def first():\n    return int(os.environ['RANK']) == 0\n"
                   "def node_index():\n    return int(os.environ['LOCAL_RANK'])\n"}
    sev = {f[3] for f in found_in(tmp_path, files, "missing-set-device")}
    assert sev <= {"warning"} and sev
    # with the entry point in view and no bind anywhere, it stays an error
    files["train.py"] = "from dist import start_group\nfrom base import Trainer\n" \
                        "if __name__ == '__main__':\n    start_group()\n    Trainer(None)\n"
    assert "error" in {f[3] for f in found_in(tmp_path / "b", files, "missing-set-device")}


def test_a_set_up_helper_out_of_view_in_the_entry_script_makes_missing_set_device_a_warning(tmp_path):
    got = found_in(tmp_path, {"train.py": OUT_OF_VIEW_SETUP_ENTRY, "trainer.py": CUDA_TRAINER},
                   "missing-set-device")
    assert [f[3] for f in got] == ["warning"]


def test_an_entry_script_in_view_that_binds_the_device_covers_the_trainer(tmp_path):
    got = found_in(tmp_path, {"run_training.py": BINDING_ENTRY, "train_script.py": IMPORTED_LOOP}, "missing-set-device")
    assert got == []


def test_a_cuda_use_in_the_other_branch_of_the_bind_is_not_before_it():
    assert found(BIND_IN_ONE_BRANCH, "missing-set-device") == []
    before = BIND_IN_ONE_BRANCH.replace("        torch.cuda.set_device(opts.local_rank)\n",
                            "        x = torch.zeros(1).cuda()\n        torch.cuda.set_device(opts.local_rank)\n")
    assert [f[0] for f in found(before, "missing-set-device")] == ["missing-set-device"]


def test_doras_init_binds_the_device():
    assert found(DORA_INIT, "missing-set-device") == []
    other = DORA_INIT.replace("from dora import distrib as dora_distrib", "from mylib import distrib as dora_distrib")
    assert [f[2] for f in found(other, "missing-set-device")] == ["warning"]


def test_a_barrier_before_set_device():
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    def init(args):
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
        dist.barrier()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    """)
    assert found(src, "collective-before-set-device") == [("collective-before-set-device", 6, "warning")]


def test_an_env_launch_path_that_never_binds_a_device():
    # one set_device elsewhere in the file (the SLURM path) used to silence the rule
    src = textwrap.dedent("""
    import datetime, os, torch
    import torch.distributed as dist
    def start(opts):
        if "SLURM_PROCID" in os.environ:
            opts.rank = int(os.environ["SLURM_PROCID"])
            opts.gpu = opts.rank % torch.cuda.device_count()
            torch.cuda.set_device(opts.gpu)
        elif "RANK" in os.environ:
            opts.rank, opts.gpu = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            pass
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    x = torch.zeros(2).cuda()
    """)
    assert ("missing-set-device", 10, "warning") in found(src)


def test_init_device_mesh_binds_the_device():  # pytorch/examples tensor_parallel_example.py
    src = ("import os, torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
           "mesh = init_device_mesh('cuda', (int(os.environ['WORLD_SIZE']),))\n"
           "model = torch.nn.Linear(2, 2).to('cuda')\n")
    assert ("missing-set-device", "error") not in rule_severities(src)


def test_named_devices_without_a_bind_are_a_warning_and_gloo_needs_none():  # ddp/example.py
    base = ("import os, torch, torch.distributed as dist\nr = int(os.environ['LOCAL_RANK'])\n"
            "dist.init_process_group({b!r}, timeout=t)\nmodel = torch.nn.Linear(2, 2).cuda(r)\n")
    # tensor collectives run on their tensors' devices: only object collectives stage on
    # the current device (cuda:0 when nothing is bound); the ddp/example.py warning was false
    assert not [r for r in rule_severities(base.format(b="nccl")) if r[0] == "missing-set-device"]
    objects = base.format(b="nccl") + "dist.all_gather_object(out, {'loss': 1.0})\n"
    assert ("missing-set-device", "warning") in rule_severities(objects)
    assert not [r for r in rule_severities(base.format(b="gloo")) if r[0] == "missing-set-device"]
    unnamed = base.format(b="nccl").replace(".cuda(r)", ".cuda()")
    assert ("missing-set-device", "error") in rule_severities(unnamed)


def test_cuda_on_the_single_process_branch_needs_no_bound_device():
    # yolov7-pytorch: every use on the distributed path names cuda:local_rank; the bare
    # "cuda" is the `else` of `if distributed:`, one process, where cuda:0 is right
    src = textwrap.dedent("""
    import os, datetime, torch
    import torch.distributed as dist
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cuda")
    net = torch.nn.Linear(2, 2).to(device)
    """)
    assert found(src, "missing-set-device") == []
    # the look-alike: the bare "cuda" on the distributed path defaults every rank to cuda:0
    shared = src.replace('    device = torch.device("cuda", local_rank)\n', '    device = torch.device("cuda")\n')
    assert found(shared, "missing-set-device") == [("missing-set-device", 8, "error")]
