"""A warm spare's rehearsal of its first sharded step (`train.spare_rehearsal`): it
leaves nothing behind but torch's sharding plans, and a spare promoted to another place
than it rehearsed computes and saves exactly as one that rehearsed its own."""

from __future__ import annotations

import pytest
from conftest import launch_worker

from disttrain.config import Config
from disttrain.config.schema import ParallelConfig, TrainConfig
from disttrain.train.spare_rehearsal import pays


def test_a_spare_at_its_rehearsed_place_or_another_trains_and_saves_the_same(tmp_path):
    (tmp_path / "same").mkdir()
    (tmp_path / "swapped").mkdir()
    same = launch_worker("rehearsed_step.py", 2, tmp_path / "same", "same")
    swapped = launch_worker("rehearsed_step.py", 2, tmp_path / "swapped", "swapped")
    for rank, (a, b) in enumerate(zip(same, swapped, strict=True)):
        for r in (a, b):
            assert r["rehearsed_s"] is not None and r["left_a_group"] is False, r
            assert r["parameters"] == [rank] and r["moments"] == [rank], r
            assert r["save_error"] == "", r
        assert a["weights"] == b["weights"]  # bit for bit
    assert same[0]["weights"] == same[1]["weights"]


@pytest.mark.parametrize("parallel, train, wanted", [
    (ParallelConfig(strategy="fsdp", device="cpu"), TrainConfig(), True),
    (ParallelConfig(strategy="ddp", device="cpu"), TrainConfig(), False),  # no DTensor: nothing to warm
    (ParallelConfig(strategy="fsdp", device="cpu"), TrainConfig(compile=True), False),
    (ParallelConfig(strategy="fsdp", device="cuda"), TrainConfig(), False),  # the GPU is the trainer's
])
def test_a_spare_rehearses_only_sharded_steps_on_the_cpu(parallel, train, wanted):
    assert pays(Config(parallel=parallel, train=train)) is wanted
