"""`[elastic] fast_recovery` under FSDP: a shard lives on one rank only, so each rank's
shard (and its optimizer state) is also kept in its buddy's CPU memory
(`elastic.buddy_copy`); a newcomer gets the dead rank's shard from the buddy. At w=4
the runs are tensor parallel 2 x data parallel 2, whose shards are 2D, and a kill there
also resumes on torchrun's restart path from the disk checkpoint. Real torchrun, real
SIGKILLs; each run must end bit-identical to an uninterrupted one, every sample exactly
once. Every wait has a timeout: a hang fails the test."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import built_once
from elastic_helpers import assert_same_fast_run, run_trainer

from disttrain.elastic.buddy_copy import buddy_shift, choose_step, load_model_in_place, pack, unpack

STEPS = 18
FSDP = ("--parallel.strategy=fsdp", "--elastic.fast_recovery=true", "--checkpoint.every=4")
PHASES = ["forward", "backward", "step", "buddy"]


TP = {2: 1, 4: 2}
"""The tensor-parallel degree of the runs at each world size."""


def _run(out: Path, nproc: int, *extra: str, fault: str = "", timeout: float = 300, launcher: tuple = ()) -> str:
    return run_trainer(out, f"--train.steps={STEPS}", f"--parallel.tp={TP[nproc]}", *extra, fault=fault,
                       run_flags=("--nproc", str(nproc), *launcher), timeout=timeout)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, Path]:
    """Uninterrupted FSDP runs at w=2 and w=4 (tp 2 x dp 2; plain torchrun path, no supervisor)."""
    def run(tmp: Path) -> dict[int, Path]:
        refs = {nproc: tmp / f"ref{nproc}" for nproc in (2, 4)}
        for nproc, out in refs.items():
            out.mkdir()
            _run(out, nproc, "--parallel.strategy=fsdp", "--checkpoint.every=4")
        return refs

    return built_once(tmp_path_factory, "fast-recovery-fsdp-refs", run)


def assert_same_run(ref: Path, out: Path, nproc: int) -> None:
    # 4 samples per data-parallel rank: the ranks of a TP group read one batch
    assert_same_fast_run(ref, out, steps=STEPS, samples_per_step=4 * nproc // TP[nproc], unlogged=4)


def _kill(step: int, phase: str, rank: int, attempt: int) -> str:
    return f"kill@{phase}:rank={rank},step={step},restart={attempt}"


def test_w2_kills_at_random_points_and_during_the_buddy_copy(references, tmp_path):
    """Two kill -9 at random (step, phase, rank) points, then one while the copy of step
    13 is in flight: each newcomer gets the dead rank's shard from its buddy, nothing
    is read from disk, no torchrun restart."""
    seed = int(os.environ.get("DISTTRAIN_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    points = [(s, rng.choice(PHASES), rng.randrange(2)) for s in sorted(rng.sample(range(2, 12), 2))]
    points.append((13, "buddy", rng.randrange(2)))
    print(f"fault seed {seed}: {points}")
    text = _run(tmp_path, 2, *FSDP, fault=";".join(_kill(s, ph, r, k) for k, (s, ph, r) in enumerate(points)))
    assert text.count("took over and the job goes on from memory") == 3, f"seed {seed}"  # warm or just started
    assert text.count("restored from memory (shards of ranks") == 3, f"seed {seed}"
    assert "loading the newest checkpoint" not in text and "will restart worker group" not in text
    assert_same_run(references[2], tmp_path, 2)


def test_w4_two_ranks_at_once_then_a_buddy_during_the_hand_over(references, tmp_path):
    """w=4 (tp 2 x dp 2: ranks 0 and 1 split each layer, so do 2 and 3). Ranks 0 and 2 die
    in the same step: their buddies (1 and 3) hand both 2D shards over. Then rank 2 dies
    again, and its buddy (rank 3) dies while handing the shard over: that shard is
    nowhere in memory, so the disk checkpoint of step 12 is loaded.
    (Each promoted spare starts a generation: the two first deaths lead to generation 2.)"""
    fault = ";".join([_kill(7, "backward", 0, 0), _kill(7, "backward", 2, 0),
                      _kill(14, "forward", 2, 2), _kill(13, "recovery", 3, 3)])
    text = _run(tmp_path, 4, *FSDP, fault=fault, timeout=420)
    assert text.count("took over and the job goes on from memory") == 4  # rank 2 twice: warm or just started
    assert re.search(r"step \d+ restored from memory \(shards of ranks \[0, 2\] from their buddies\)", text)
    assert "no step has every shard in memory; loading the newest checkpoint" in text
    assert "resumed at step 12" in text
    assert "will restart worker group" not in text
    assert_same_run(references[4], tmp_path, 4)


def test_w4_kill_9_restarts_from_the_checkpoint(references, tmp_path):
    """w=4 (tp 2 x dp 2) without fast recovery: torchrun restarts every rank and the run
    resumes from the disk checkpoint of step 4 (the batch policy counts the 2
    data-parallel ranks), bit-identical, with the same samples at every step."""
    text = _run(tmp_path, 4, "--parallel.strategy=fsdp", "--checkpoint.every=4", launcher=("--max-restarts", "1"),
                fault="kill@backward:rank=3,step=7")
    assert "torchrun restarts the job from its newest checkpoint" in text
    assert "resumed at step 4 (epoch 0, sample 32) on 2 data-parallel rank(s)" in text
    assert_same_run(references[4], tmp_path, 4)


def test_buddy_every_3_goes_back_to_the_last_copy(references, tmp_path):
    """`elastic.buddy_every = 3`: copies at steps 3, 6, 9...; a kill in step 8 goes back
    to step 6 (from memory, not the disk checkpoint of step 4) and redoes 7 and 8."""
    text = _run(tmp_path, 2, *FSDP, "--elastic.buddy_every=3", fault=_kill(8, "backward", 1, 0))
    assert "generation 1: step 6 restored from memory" in text
    assert "loading the newest checkpoint" not in text
    assert_same_run(references[2], tmp_path, 2)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_bad_buddy_every_is_one_clear_error(value):
    from disttrain.config import load_config
    from disttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"elastic\.buddy_every.? is -?[0-9]+.*at least 1"):
        load_config("examples/tiny_gpt.toml", [f"--elastic.buddy_every={value}"])


# ---------------------------------------------------------------- the parts, in one process


def _offer(new: bool, mine=(), theirs=()) -> dict:
    return {"new": new, "mine": list(mine), "theirs": list(theirs)}


def test_choose_step_takes_the_newest_step_held_for_every_shard():
    # rank 1 died; rank 2 (its buddy) holds its step 5 only: the others roll back to 5
    offers = [_offer(False, (5, 6), (6,)), _offer(True), _offer(False, (5, 6), (5,)), _offer(False, (5, 6), (6,))]
    assert choose_step(offers) == 5
    # two neighbours dead: rank 1's shard was only on rank 2
    offers[2] = _offer(True)
    assert choose_step(offers) is None
    # nobody died (a failure that killed no rank): each keeps its own newest step
    assert choose_step([_offer(False, (3, 4), (4,)), _offer(False, (4,), (4,))]) == 4


def test_buddies_sit_on_another_node_so_a_lost_node_leaves_every_shard():
    # one node: the next rank; several nodes: the same local rank on the next node
    assert [(r + buddy_shift(4, 4)) % 4 for r in range(4)] == [1, 2, 3, 0]
    assert [(r + buddy_shift(4, 2)) % 4 for r in range(4)] == [2, 3, 0, 1]
    assert [(r + buddy_shift(6, 2)) % 6 for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [(r + buddy_shift(2, 1)) % 2 for r in range(2)] == [1, 0]
    assert buddy_shift(5, 2) == 1  # ranks that do not fill equal nodes: the next rank
    # 2 nodes x 2 ranks, node 1 (ranks 2 and 3) lost: ranks 0 and 1 hold both its shards
    offers = [_offer(False, (5, 6), (6,)), _offer(False, (5, 6), (6,)), _offer(True), _offer(True)]
    assert choose_step(offers, buddy_shift(4, 2)) == 6
    assert choose_step(offers, 1) is None  # within one node, rank 2's shard was on rank 3 only


def test_pack_and_unpack_keep_every_tensor_bit_for_bit():
    sd = {"tensors": {"model": {"w": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.int64)},
                      "optim": {"state": {"w": {"step": torch.tensor(7.0), "flag": torch.tensor([True, False])}},
                                "param_groups": [{"lr": 0.1, "params": ["w"]}]}},
          "meta": {"step": 7, "sampler": {"epoch": 1}}, "rng": {"cpu": torch.randint(0, 255, (9,), dtype=torch.uint8)}}
    buf = pack(sd)
    back = unpack(buf, sd)
    assert back["meta"] == sd["meta"] and back["tensors"]["optim"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    for path in (("tensors", "model", "w"), ("tensors", "model", "b"), ("rng", "cpu")):
        a, b = sd, back
        for k in path:
            a, b = a[k], b[k]
        assert a.dtype == b.dtype and torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert torch.equal(back["tensors"]["optim"]["state"]["w"]["flag"], torch.tensor([True, False]))
    with pytest.raises(OverflowError, match="buffer holds"):
        pack(sd, capacity=buf.numel() - 1)


def test_a_state_loaded_in_place_or_refused_as_load_state_dict_refuses_it():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    storages = {k: v.data_ptr() for k, v in model.state_dict().items()}
    load_model_in_place(model, sd)
    live = model.state_dict()
    assert all(torch.equal(live[k], sd[k]) and live[k].data_ptr() == storages[k] for k in sd)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model_in_place(model, {k: v for k, v in sd.items() if k != "0.bias"})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_model_in_place(model, {**sd, "0.weight": torch.zeros(2, 4)})
