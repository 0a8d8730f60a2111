"""unguarded-log: a print or log line every rank repeats, and the look-alikes that are
per rank on purpose or already rank-aware.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import PRE, RANK_ZERO_HELPERS, findings, found, found_in, rule_severities, rules

from disttrain.doctor.analyzer import parse
from disttrain.doctor.dataflow import Project

PKG_ENTRY = """
import fourm.utils as utils
def main(cfg):
    utils.start_from_env(cfg)
    print("building the network")
if __name__ == "__main__":
    main(None)
"""

# ml-4m: the print override is installed by a helper of a package whose __init__ (the
# re-export) is not among the files: `import fourm.utils as utils` reaches
# fourm/utils/dist.py all the same
PKG_DIST_HELPERS = RANK_ZERO_HELPERS

# DPR's options.py: set-up diagnostics that name this process (its rank as a %-argument
# of a logger call, its SLURM ids); CosyVoice: a message built with the rank appended
SETUP_DIAGNOSTICS = PRE + """
import logging
logging.basicConfig(level=logging.INFO)
logger = logging.getLogger()
def describe_process(cfg):
    logger.info("this process: local rank %s", cfg.local_rank)
    proc_id = os.environ.get("SLURM_PROCID")
    logger.info("slurm task id %s", proc_id)
    logger.info("half precision: %s", cfg.fp16)
def report_step(loss):
    line = "step loss {:.4f}".format(loss)
    line += " on rank {}".format(rank)
    logging.debug(line)
describe_process(None)
report_step(0.0)
"""

# nanoVLM, LatentSync: each rank's own error report
OWN_ERROR_REPORTS = PRE + """
def read_shards(names):
    texts = []
    for name in names:
        try:
            texts.append(open(name).read())
        except Exception as err:
            print(f"skipping shard {name}: {err}")
            continue
    return texts
def open_clip(path):
    if not os.path.isfile(path):
        print("error: cannot read the clip file")
        return None
    print("no snapshot to resume: starting fresh")
read_shards(["a"])
open_clip("clip.mp4")
"""

# llm.c, open_lm (rounds 1 and 5): an error report just before this rank stops with a
# failure, and a line naming a device built from the local rank; apex's profiling stop
# (`quit()`, a normal end) stays a repeated line
STOPS = PRE + """
def check_header(head):
    if head[0] != 1234:
        print("the token file has the wrong magic number")
        exit(1)
    if head[1] is None:
        print(f"no block class named in {head}")
        return -1
device = f"cuda:{local_rank}"
print(f"this process runs on {device}")
print("profiling done")
quit()
"""

# jukebox: the print in the branch where torch.distributed is not available
NO_DIST_BRANCH = PRE + """
def say_per_node(text):
    if not dist.is_available():
        print(text)
    elif dist.get_rank() % 8 == 0:
        print(f"node {dist.get_rank() // 8}: {text}")
def start():
    if dist.is_available():
        return 1
    else:
        print("single process on the GPU")
say_per_node("x")
start()
if torch.cuda.is_available():
    pass
else:
    print("no cuda")
"""

# fast-autoaugment: the ranks other than the master bind SummaryWriter to a dummy class
DUMMY_WRITER = PRE + """
first = rank == 0
if not first:
    from metrics import SummaryWriterDummy as SummaryWriter
else:
    from tensorboardX import SummaryWriter
boards = {name: SummaryWriter(log_dir=name) for name in ("fit", "eval")}
"""


def test_logging_configured_by_a_set_up_out_of_view_is_not_judged():
    src = PRE + (
        "import logging\nfrom lavis.common.logger import setup_logger\n"
        "setup_logger()\nlogging.info('training begins')\n"
    )
    assert found(src, "unguarded-log") == []


def test_print_after_a_distributed_set_up_out_of_view_is_not_judged(tmp_path):
    # SparK: `args = arg_util.init_dist_and_get_args()` (not in the files checked) installs
    # a main-process-only builtins.print, as DeiT's init_distributed_mode does in view
    files = {"main.py": PRE + textwrap.dedent("""
        from utils import arg_util
        def main():
            args = arg_util.init_dist_and_get_args()
            print(f'options: {args}')
        main()
        """)}
    assert found_in(tmp_path, files, "unguarded-log") == []
    # the same print after an init helper the doctor sees, which replaces nothing, is judged
    files["main.py"] = files["main.py"].replace("from utils import arg_util\n", "") \
        .replace("arg_util.init_dist_and_get_args()", "init_dist_and_get_args()") \
        + "def init_dist_and_get_args():\n    return None\n"
    assert [r[1] for r in found_in(tmp_path / "b", files, "unguarded-log")] == ["unguarded-log"]


def test_prints_before_a_library_launcher_spawns_the_workers_run_once():
    # Detic: detectron2.engine.launch(main, ...) from the __main__ block
    src = textwrap.dedent("""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from detectron2.engine import launch
    def worker(opts):
        print('in a worker')
        model = DistributedDataParallel(torch.nn.Linear(2, 2).cuda())
    if __name__ == "__main__":
        opts = None
        print("options given:", opts)
        launch(worker, 8, args=(opts,))
    """)
    assert [f[1] for f in found(src, "unguarded-log")] == [6]


def test_a_print_in_a_helper_nothing_calls_is_not_judged(tmp_path):
    # Latte's utils.py: find_model() and collect_env() serve the sampling scripts only
    files = {
        "train.py": PRE + "from utils import setup\nsetup()\n",
        "utils.py": "import torch.distributed as dist\ndef setup():\n    dist.init_process_group('nccl', timeout=t)\n"
                    "def pick_weights(name):\n    print('the averaged weights')\n"
                    "def report():\n    print('every rank')\nreport()\n"}
    assert [(f[0], f[2]) for f in found_in(tmp_path, files, "unguarded-log")] == [("utils.py", 7)]


def test_info_on_a_logger_nothing_configures_prints_nothing():
    # qlora: logger = logging.getLogger(__name__), no basicConfig, no handler, no level
    src = PRE + "import logging\nlogger = logging.getLogger(__name__)\nlogger.info('fitting')\n"
    assert found(src, "unguarded-log") == []
    configured = src.replace("logger.info", "logging.basicConfig(level=logging.INFO)\nlogger.info")
    assert [f[0] for f in found(configured, "unguarded-log")] == ["unguarded-log"]


def test_a_formatter_subclass_that_names_the_rank_makes_the_logging_rank_aware():
    # Open-Sora-Plan: colorlog's ColoredFormatter(f"[rank{rank}] ...")
    src = PRE + textwrap.dedent("""
    import logging
    from colorlog import ColoredFormatter
    logger = logging.getLogger()
    logger.setLevel(logging.INFO)
    formatter = ColoredFormatter(f"[rank{rank}] %(message)s")
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    logger.info("ready")
    """)
    assert found(src, "unguarded-log") == []


def test_a_helper_reached_through_a_package_without_its_init_is_seen(tmp_path):
    files = {"run.py": PKG_ENTRY, "fourm/utils/dist.py": PKG_DIST_HELPERS}
    assert found_in(tmp_path, files, "unguarded-log") == []
    def links(main_source: str) -> bool:
        run = parse("pkg/run.py", textwrap.dedent(main_source))
        dist = parse("pkg/fourm/utils/dist.py", textwrap.dedent(PKG_DIST_HELPERS))
        return id(dist) in Project([run, dist]).imports[id(run)]
    assert links(PKG_ENTRY)
    # a package that only shares the folder's last name is no link: `import torch.utils`
    assert not links(PKG_ENTRY.replace("fourm.utils", "torch.utils"))


def test_a_log_line_that_names_this_process_is_per_rank_on_purpose():
    assert [f[1] for f in found(SETUP_DIAGNOSTICS, "unguarded-log")] == [19]  # only the fp16 line


def test_a_ranks_own_error_report_is_no_repeated_log_line():
    assert [f[1] for f in found(OWN_ERROR_REPORTS, "unguarded-log")] == [25]


def test_an_error_report_before_a_failing_exit_and_a_rank_device_line_are_per_rank():
    assert [f[1] for f in found(STOPS, "unguarded-log")] == [21]


def test_the_branch_without_torch_distributed_is_one_process():
    assert [f[1] for f in found(NO_DIST_BRANCH, "unguarded-log")] == [27]  # torch.cuda's is no such test


def test_a_summary_writer_bound_to_a_dummy_on_the_other_ranks_is_rank_aware():
    assert found(DUMMY_WRITER, "unguarded-log") == []
    real = DUMMY_WRITER.replace("from metrics import SummaryWriterDummy as SummaryWriter",
                       "from tensorboard_other import SummaryWriter")
    assert [f[0] for f in found(real, "unguarded-log")] == ["unguarded-log"]


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


def test_a_print_that_names_its_rank_is_meant_per_rank():  # ddp/main.py
    src = ("import os, torch.distributed as dist\nrank = int(os.environ['RANK'])\n"
           "dist.init_process_group('nccl', timeout=t)\nprint(f'rank {rank} starts')\n"
           "print('reading the snapshot')\n")
    assert [r for r in rule_severities(src) if r[0] == "unguarded-log"] == [("unguarded-log", "warning")]
    # ZoeDepth: the rank as one of print's own arguments, beside a look-alike without it
    src = src.replace("print('reading the snapshot')\n", "print('Rank', rank, 'batch', 8)\nprint('batch', 8)\n")
    assert [f.line for f in findings(src) if f.rule == "unguarded-log"] == [6]


def test_print_in_a_fabric_script_runs_on_every_rank():  # Lightning Fabric examples
    src = ("from lightning.fabric import Fabric\nfabric = Fabric()\nprint('pass finished')\n"
           "if fabric.is_global_zero:\n    print('once')\n")
    assert [r for r in rule_severities(src) if r[0] == "unguarded-log"] == [("unguarded-log", "warning")]
