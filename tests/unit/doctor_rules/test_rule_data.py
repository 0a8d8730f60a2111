"""sampler-without-set-epoch, shard-by-local-rank, uneven-batches: what each rank reads.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import ACCELERATE_TRAINER, PRE, findings, found, rules

from disttrain.doctor.analyzer import analyze_paths, analyze_source

# DPR: the data is sharded by the node-local rank
LOCAL_RANK_SHARDS = PRE + """
class Reader:
    def __init__(self, cfg):
        self.shard_id = cfg.local_rank if cfg.local_rank >= 0 else 0
        self.shards = cfg.world
sampler = torch.utils.data.DistributedSampler(ds, rank=local_rank)
"""

# Amphion's VALL-E trainer: dynamic batches built for the whole job, each split over the
# job's process count but picked by the node-local index
LOCAL_INDEX_SPLIT = """
import numpy as np
from accelerate import Accelerator
accelerator = Accelerator()
def my_batches(groups):
    np.random.shuffle(groups)
    return [g[accelerator.local_process_index : : accelerator.num_processes] for g in groups]
loader = my_batches(list(range(8)))
"""

# pytorch/examples distributed/FSDP/LOOP_IN_ANOTHER_MODULE_training.py: samplers handed to utils.train(...)
LOOP_IN_ANOTHER_MODULE = PRE + """
from torch.utils.data import DistributedSampler, DataLoader
from loops.steps import fit_one_pass, score
fit_sampler = DistributedSampler(fit_set, rank=rank, num_replicas=2, shuffle=True)
val_sampler = DistributedSampler(val_set, rank=rank, num_replicas=2)
fit_opts = {"batch_size": 4, "sampler": fit_sampler}
val_opts = {"batch_size": 4, "sampler": val_sampler}
fit_loader = DataLoader(fit_set, **fit_opts)
val_loader = DataLoader(val_set, **val_opts)
for epoch in range(1, 3):
    acc = fit_one_pass(model, rank, fit_loader, optimizer, epoch, sampler=fit_sampler)
    val_loss = score(model, rank, val_loader)
"""


def test_a_sampler_appended_to_a_list_hides_no_set_epoch():
    src = PRE + textwrap.dedent("""
    from torch.utils.data import DistributedSampler
    samplers = []
    for ds in datasets:
        sampler = DistributedSampler(ds)
        samplers.append(sampler)
    for epoch in range(3):
        pass
    """)
    fs = [f for f in analyze_source("s.py", src) if f.rule == "sampler-without-set-epoch"]
    assert fs and not any("append" in f.message for f in fs)  # a list is no callee that hides it


def test_even_batches_off_gives_ranks_uneven_batch_counts():
    assert [f[1] for f in found(ACCELERATE_TRAINER, "uneven-batches")] == [11]
    joined = ACCELERATE_TRAINER.replace(
        "        for batch in loader:",
        "        with self.accelerator.join_uneven_inputs([self.model]):\n          for batch in loader:",
    )
    assert found(joined, "uneven-batches") == []


def test_data_sharded_by_the_local_rank_repeats_on_every_node():
    assert [f[1] for f in found(LOCAL_RANK_SHARDS, "shard-by-local-rank")] == [14, 16]
    fixed = LOCAL_RANK_SHARDS.replace("cfg.local_rank if cfg.local_rank >= 0 else 0", "dist.get_rank()").replace(
        "rank=local_rank", "rank=rank")
    assert found(fixed, "shard-by-local-rank") == []


def test_a_batch_split_over_the_job_but_picked_by_the_local_index_is_found():
    assert [f[:2] for f in found(LOCAL_INDEX_SPLIT, "shard-by-local-rank")] == [("shard-by-local-rank", 7)]
    glob = LOCAL_INDEX_SPLIT.replace("local_process_index", "process_index")
    assert found(glob, "shard-by-local-rank") == []
    per_node = LOCAL_INDEX_SPLIT.replace("accelerator.num_processes]", "torch.cuda.device_count()]")
    assert found(per_node, "shard-by-local-rank") == []


def test_sampler_passed_to_a_function_defined_elsewhere_is_a_warning():
    found = [f for f in findings(LOOP_IN_ANOTHER_MODULE) if f.rule == "sampler-without-set-epoch"]
    assert [(f.line, f.severity) for f in found] == [(LOOP_IN_ANOTHER_MODULE.splitlines().index(
        "fit_sampler = DistributedSampler(fit_set, rank=rank, num_replicas=2, shuffle=True)") + 1,
        "warning")]
    assert "fit_one_pass()" in found[0].message and "not defined" in found[0].message


def test_sampler_passed_to_a_function_in_the_file_is_followed():
    calls = LOOP_IN_ANOTHER_MODULE.replace("from loops.steps import fit_one_pass, score\n", "")
    with_set_epoch = calls + "def fit_one_pass(net, rank, batches, opt, epoch, sampler=None):\n" \
        "    sampler.set_epoch(epoch)\n"
    assert "sampler-without-set-epoch" not in rules(with_set_epoch)
    without = calls + "def fit_one_pass(net, rank, batches, opt, epoch, sampler=None):\n    pass\n"
    found = [f for f in findings(without) if f.rule == "sampler-without-set-epoch"]
    assert [f.severity for f in found] == ["error"]


def test_sampler_followed_into_another_file_given_on_the_command_line(tmp_path):
    (tmp_path / "run.py").write_text(LOOP_IN_ANOTHER_MODULE)
    loops = tmp_path / "loops"
    loops.mkdir()
    (loops / "steps.py").write_text(
        "def fit_one_pass(net, rank, batches, opt, epoch, sampler=None):\n"
        "    if sampler:\n        sampler.set_epoch(epoch)\n"
        "def score(net, rank, batches):\n    pass\n")
    _, found = analyze_paths([str(tmp_path)])
    assert [f for f in found if f.rule == "sampler-without-set-epoch"] == []


def test_sampler_given_to_an_iterator_is_an_error_and_to_a_class_a_warning():
    base = PRE + """
from torch.utils.data import DistributedSampler, DataLoader
from tqdm import tqdm
sampler = DistributedSampler(ds)
loader = DataLoader(ds, sampler=sampler)
"""
    wrapped = base + "for epoch in range(3):\n    for b in tqdm(loader):\n        pass\n"
    trainer = base + "class Trainer:\n    def __init__(self, data):\n        self.data = data\n" \
        "    def run(self):\n        for epoch in range(3):\n            pass\nTrainer(loader).run()\n"
    # the class keeps the loader, and no loop the doctor sees reads it again: no witness
    for src, severity in ((wrapped, "error"), (trainer, "warning")):
        found = [f for f in findings(src) if f.rule == "sampler-without-set-epoch"]
        assert [f.severity for f in found] == [severity]


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
