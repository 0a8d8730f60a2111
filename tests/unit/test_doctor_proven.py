"""The doctor's errors are proven (issue 39): each false error found on public projects
the doctor was never shown, as a small program of our own, with the look-alike that
must still be reported.

- a flag whose name contains "rank" is no rank: rank values come from data flow;
- a constant argument is followed into the helper and the context manager it
  parameterises (`rank=-1` turns a zero-first barrier off);
- set_epoch is counted through the loader a helper returns, in the caller's file;
- what the doctor cannot see makes a finding a warning that says what it could not see.

Each test of a cause failed on the doctor before issue 39 (the look-alikes, which must
still be reported, passed there too). Programs of several files are written to tmp_path
and checked in one run, as `disttrain doctor train.py data/` checks them.
"""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_paths, analyze_source

SETUP = """
import datetime, os
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
"""


def found(source: str, rule: str) -> list[tuple[int, str]]:
    """(line, severity) of each finding of `rule` in one script."""
    return [(f.line, f.severity) for f in analyze_source("job.py", textwrap.dedent(source)) if f.rule == rule]


def found_in(tmp_path, files: dict[str, str], rule: str) -> list[tuple[str, int, str]]:
    """(file name, line, severity) of each finding of `rule` in a program of several files."""
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    _, fs = analyze_paths([str(tmp_path)])
    return [(str(f.file).rsplit("/", 1)[-1], f.line, f.severity) for f in fs if f.rule == rule]


def line_of(source: str, text: str) -> int:
    """The 1-based line of the first line of `source` (dedented) that contains `text`."""
    lines = textwrap.dedent(source).splitlines()
    return next(i for i, x in enumerate(lines, 1) if text in x)


# ----- a name is not a rank ------------------------------------------------------------

# A contrastive head with an option, named after the ranks it mixes, that pools hard
# negatives from every process: a setting that is the same on every rank.
POOLED = SETUP + """
def pool_all(t):
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)

class PairLoss(torch.nn.Module):
    def __init__(self, mine_across_rank=False):
        super().__init__()
        self.mine_across_rank = mine_across_rank

    def forward(self, feats):
        if self.mine_across_rank:
            bank = pool_all(feats)
            dist.all_reduce(bank)
        else:
            bank = feats
        return bank.sum()

loss = PairLoss(mine_across_rank=True)(torch.ones(4))
"""


def test_a_setting_whose_name_contains_rank_is_no_rank_guard():
    assert found(POOLED, "collective-under-rank-guard") == []


def test_a_rank_flag_from_data_flow_is_still_a_guard():
    lead = POOLED.replace("self.mine_across_rank = mine_across_rank",
                          "self.mine_across_rank = dist.get_rank() == 0")
    got = found(lead, "collective-under-rank-guard")
    assert (line_of(lead, "dist.all_reduce(bank)"), "error") in got
    # pool_all is called under the guard only: its all_gather is reported where it stands
    assert (line_of(lead, "dist.all_gather(parts, t)"), "error") in got


def test_a_name_compared_like_a_rank_is_a_warning_that_says_it_rests_on_the_name():
    # no data flow makes it a rank: the doctor guesses from the name and says so
    compared = POOLED.replace("if self.mine_across_rank:", "if self.mine_across_rank == 0:")
    got = [f for f in analyze_source("job.py", textwrap.dedent(compared)) if f.rule == "collective-under-rank-guard"]
    # the all_reduce under the test, and the all_gather of the helper called only there
    assert sorted((f.line, f.severity) for f in got) == [
        (line_of(compared, "dist.all_gather(parts, t)"), "warning"),
        (line_of(compared, "dist.all_reduce(bank)"), "warning")]
    assert all("`self.mine_across_rank` for a rank from its name alone" in f.message for f in got)


def test_the_bare_name_of_a_rank_compared_with_zero_stays_an_error():
    bare = POOLED.replace("if self.mine_across_rank:", "if self.rank == 0:")
    assert (line_of(bare, "dist.all_reduce(bank)"), "error") in found(bare, "collective-under-rank-guard")


# ----- constant arguments are followed -------------------------------------------------

LOADERS = """
import contextlib
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

@contextlib.contextmanager
def leader_prepares_first(rank):
    # the other processes wait while the leader builds the cache, then the leader waits
    if rank not in (-1, 0):
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()

def build_loader(split, batch, rank=-1):
    with leader_prepares_first(rank):
        items = list(range(100))
    sampler = None if rank == -1 else DistributedSampler(items, shuffle=False)
    return DataLoader(items, batch_size=batch, sampler=sampler)
"""

TRAIN = SETUP + """
from loaders import build_loader
RANK = int(os.getenv("RANK", -1))
train_loader = build_loader("train", 16, rank=RANK)
if RANK in {-1, 0}:
    val_loader = build_loader("val", 32, rank=-1)
"""


def test_a_constant_argument_turns_the_helpers_barrier_off(tmp_path):
    assert found_in(tmp_path, {"loaders.py": LOADERS, "train.py": TRAIN}, "collective-under-rank-guard") == []


def test_a_constant_argument_that_turns_the_barrier_on_is_an_error(tmp_path):
    on = TRAIN.replace('build_loader("val", 32, rank=-1)', 'build_loader("val", 32, rank=0)')
    line = line_of(on, 'build_loader("val"')
    assert found_in(tmp_path, {"loaders.py": LOADERS, "train.py": on}, "collective-under-rank-guard") == [
        ("train.py", line, "error")]


def test_a_default_argument_is_followed_too(tmp_path):
    default = TRAIN.replace('build_loader("val", 32, rank=-1)', 'build_loader("val", 32)')
    assert found_in(tmp_path, {"loaders.py": LOADERS, "train.py": default}, "collective-under-rank-guard") == []


def test_a_barrier_the_helper_reaches_only_under_its_own_condition_is_a_warning(tmp_path):
    # the guarded rank passes its own rank: rank 0 reaches the second barrier, but the
    # doctor cannot prove which value arrives, so it says so at warning severity
    own = TRAIN.replace('build_loader("val", 32, rank=-1)', 'build_loader("val", 32, rank=RANK)')
    line = line_of(own, 'build_loader("val"')
    assert found_in(tmp_path, {"loaders.py": LOADERS, "train.py": own}, "collective-under-rank-guard") == [
        ("train.py", line, "warning")]


def test_an_unconditional_barrier_in_the_helper_stays_an_error(tmp_path):
    plain = LOADERS.replace("    with leader_prepares_first(rank):\n",
                            "    dist.barrier()\n    with leader_prepares_first(rank):\n")
    assert plain != LOADERS
    line = line_of(TRAIN, 'build_loader("val"')
    assert found_in(tmp_path, {"loaders.py": plain, "train.py": TRAIN}, "collective-under-rank-guard") == [
        ("train.py", line, "error")]


# ----- set_epoch through a returned loader ---------------------------------------------

DATA = """
import torch
from torch.utils.data import DataLoader, DistributedSampler

def make_train_loader(dataset, batch):
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    return loader

def describe(loader):
    for batch in loader:
        return batch.shape
"""

FIT = SETUP + """
from data import make_train_loader
loader = make_train_loader(list(range(64)), 8)
for epoch in range(3):
    loader.sampler.set_epoch(epoch)
    for batch in loader:
        pass
"""


def test_set_epoch_is_counted_through_the_loader_a_helper_returns(tmp_path):
    assert found_in(tmp_path, {"data.py": DATA, "fit.py": FIT}, "sampler-without-set-epoch") == []


def test_a_returned_loader_whose_caller_never_sets_the_epoch_is_an_error(tmp_path):
    never = FIT.replace("    loader.sampler.set_epoch(epoch)\n", "")
    line = line_of(DATA, "DistributedSampler(dataset")
    assert found_in(tmp_path, {"data.py": DATA, "fit.py": never}, "sampler-without-set-epoch") == [
        ("data.py", line, "error")]


def test_a_returned_loader_with_no_caller_in_view_is_a_warning_that_says_so(tmp_path):
    got = analyze_source("data.py", textwrap.dedent(DATA))
    hits = [f for f in got if f.rule == "sampler-without-set-epoch"]
    assert [(f.line, f.severity) for f in hits] == [(line_of(DATA, "DistributedSampler(dataset"), "warning")]
    assert "make_train_loader()" in hits[0].message and "not in the files checked" in hits[0].message


# The same cause in two other shapes: the sampler made only when distributed and handed
# straight to the returned loader; samplers collected in a list that the helper returns.
DATA_SHAPES = """
import torch
from torch.utils.data import DataLoader, DistributedSampler

def image_loader(dataset, batch, rank=-1):
    sampler = None if rank == -1 else DistributedSampler(dataset, shuffle=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, shuffle=sampler is None)

def samplers_for(datasets, world, rank):
    out = []
    for ds in datasets:
        s = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
        out.append(s)
    return out
"""

FIT_SHAPES = SETUP + """
from data import image_loader, samplers_for
loader = image_loader(list(range(64)), 8, rank=dist.get_rank())
train_sampler, = samplers_for([list(range(64))], dist.get_world_size(), dist.get_rank())
for epoch in range(3):
    loader.sampler.set_epoch(epoch)
    train_sampler.set_epoch(epoch)
    for batch in loader:
        pass
"""


def test_a_conditional_or_listed_sampler_returned_by_a_helper_is_followed(tmp_path):
    assert found_in(tmp_path, {"data.py": DATA_SHAPES, "fit.py": FIT_SHAPES}, "sampler-without-set-epoch") == []


def test_the_same_helpers_with_no_caller_in_view_are_warnings(tmp_path):
    got = analyze_source("data.py", textwrap.dedent(DATA_SHAPES))
    assert sorted((f.line, f.severity) for f in got if f.rule == "sampler-without-set-epoch") == [
        (line_of(DATA_SHAPES, "sampler = None if"), "warning"),
        (line_of(DATA_SHAPES, "s = DistributedSampler"), "warning"),
    ]


# The helper itself is called only under the guard, with a constant that turns its own
# collective off: the collective is judged where it stands, through its call sites.
SYNC_HELPER = SETUP + """
RANK = int(os.environ["RANK"])

def write_report(path, wait=False):
    if wait:
        dist.barrier()
    open(path, "w").write("done")

if RANK == 0:
    write_report("report.txt", wait=False)
"""


def test_a_helper_called_only_under_the_guard_with_its_collective_turned_off_is_not_reported():
    assert found(SYNC_HELPER, "collective-under-rank-guard") == []


def test_the_same_helper_called_with_its_collective_turned_on_is_reported():
    on = SYNC_HELPER.replace("wait=False)\n", "wait=True)\n")
    assert [line for line, _ in found(on, "collective-under-rank-guard")] == [line_of(on, "dist.barrier()")]


def test_a_returned_loader_handed_to_a_function_out_of_view_is_a_warning(tmp_path):
    handed = SETUP + """
from data import make_train_loader
from engine import fit_epochs
loader = make_train_loader(list(range(64)), 8)
fit_epochs(loader, epochs=3)
"""
    got = found_in(tmp_path, {"data.py": DATA, "fit.py": handed}, "sampler-without-set-epoch")
    assert got == [("data.py", line_of(DATA, "DistributedSampler(dataset"), "warning")]


def test_constants_are_followed_once_per_function_and_value():
    # five layers of helpers, each calling the next one forty times with the same
    # constant: walked once per (helper, value), not forty to the fifth times
    layers = ["def layer5(wait=False):\n    if wait:\n        dist.barrier()\n"]
    for i in range(4, -1, -1):
        calls = "".join(f"    layer{i + 1}(wait=wait)\n" for _ in range(40))
        layers.append(f"def layer{i}(wait=False):\n{calls}")
    src = SETUP + "".join(layers) + (
        "layer0()\nif dist.get_rank() == 0:\n    layer0(wait=True)\n    layer0(wait=False)\n"
    )
    assert found(src, "collective-under-rank-guard") == [(line_of(src, "layer0(wait=True)"), "error")]


def test_a_rank_set_out_of_view_before_an_early_exit_is_a_warning_that_says_so():
    """`if rank != 0: return` before a barrier, with `rank` a parameter nothing in view
    fills: the exit rests on the name alone. With `rank` read from RANK it is proven."""
    unseen = """
    import torch.distributed as dist

    class Syncer:
        def only_zero_waits(self, rank):
            if rank != 0:
                return
            dist.barrier()

        def all_but_zero_wait(self, rank):
            if rank == 0:
                return
            dist.barrier()
    """
    assert found(unseen, "collective-under-rank-guard") == [(8, "warning"), (13, "warning")]
    seen = SETUP + textwrap.dedent("""
    rank = int(os.environ["RANK"])

    def only_zero_waits():
        if rank != 0:
            return
        dist.barrier()
    """)
    assert [s for _, s in found(seen, "collective-under-rank-guard")] == ["error"]
