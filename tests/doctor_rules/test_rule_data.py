"""sampler-without-set-epoch, shard-by-local-rank, uneven-batches: what each rank reads.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_paths
from disttrain.doctor.analyzer import analyze_source
from rule_check import PRE, F5, found, findings, rules

# DPR: the data is sharded by the node-local rank
DPR_SHARD = PRE + """
class Trainer:
    def __init__(self, cfg):
        self.shard_id = cfg.local_rank if cfg.local_rank != -1 else 0
        self.num_shards = cfg.distributed_world_size
sampler = torch.utils.data.DistributedSampler(ds, rank=local_rank)
"""

# Amphion's VALL-E trainer: dynamic batches built for the whole job, each split over the
# job's process count but picked by the node-local index
AMPHION = """
import numpy as np
from accelerate import Accelerator
accelerator = Accelerator()
def build(batch_sampler):
    np.random.shuffle(batch_sampler)
    return [x[accelerator.local_process_index : : accelerator.num_processes] for x in batch_sampler]
loader = build(list(range(8)))
"""

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
    assert [f[1] for f in found(F5, "uneven-batches")] == [11]
    joined = F5.replace("        for batch in loader:", "        with self.accelerator.join_uneven_inputs([self.model]):\n"
                        "          for batch in loader:")
    assert found(joined, "uneven-batches") == []


def test_data_sharded_by_the_local_rank_repeats_on_every_node():
    assert [f[1] for f in found(DPR_SHARD, "shard-by-local-rank")] == [14, 16]
    fixed = DPR_SHARD.replace("cfg.local_rank if cfg.local_rank != -1 else 0", "dist.get_rank()").replace(
        "rank=local_rank", "rank=rank")
    assert found(fixed, "shard-by-local-rank") == []


def test_a_batch_split_over_the_job_but_picked_by_the_local_index_is_found():
    assert [f[:2] for f in found(AMPHION, "shard-by-local-rank")] == [("shard-by-local-rank", 7)]
    glob = AMPHION.replace("local_process_index", "process_index")
    assert found(glob, "shard-by-local-rank") == []
    per_node = AMPHION.replace("accelerator.num_processes]", "torch.cuda.device_count()]")
    assert found(per_node, "shard-by-local-rank") == []


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
