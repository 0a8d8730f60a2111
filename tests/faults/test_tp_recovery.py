"""A kill -9 at tensor parallel 2 x data parallel 2 (4 ranks, fsdp) through `disttrain
train`: on torchrun's restart path (the disk checkpoint) and under `elastic.fast_recovery`
(the dead rank's TP x FSDP shards from its buddy's memory), each run ends bit-identical
to an uninterrupted one, with the same samples at every step. Real torchrun, real
SIGKILLs; every wait has a timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import built_once
from elastic_helpers import assert_same_fast_run, run_trainer

STEPS = 8
TP2_DP2 = ("--parallel.strategy=fsdp", "--parallel.tp=2", "--checkpoint.every=3", f"--train.steps={STEPS}")


def _run(out: Path, *extra: str, fault: str = "") -> str:
    return run_trainer(out, *TP2_DP2, *extra, run_flags=("--nproc", "4", "--max-restarts", "1"), fault=fault,
                       timeout=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    def run(out: Path) -> Path:
        _run(out)
        return out

    return built_once(tmp_path_factory, "tp-recovery-ref", run)


def assert_same_run(ref: Path, out: Path) -> None:
    # 4 samples per data-parallel rank, 2 of them: the ranks of a TP group read one batch
    assert_same_fast_run(ref, out, steps=STEPS, samples_per_step=8)


def test_kill_9_at_tp2_dp2_restarts_from_the_checkpoint_bit_exactly(reference, tmp_path):
    text = _run(tmp_path, fault="kill@backward:rank=3,step=5")
    assert "torchrun restarts the job from its newest checkpoint" in text
    assert "resumed at step 3 (epoch 0, sample 24) on 2 data-parallel rank(s)" in text
    assert_same_run(reference, tmp_path)


def test_kill_9_at_tp2_dp2_recovers_the_tp_shards_from_the_buddy(reference, tmp_path):
    text = _run(tmp_path, "--elastic.fast_recovery=true", fault="kill@backward:rank=1,step=6")
    assert "its warm spare took over" in text
    assert "step 5 restored from memory (shards of ranks [1] from their buddies)" in text
    assert "loading the newest checkpoint" not in text and "will restart worker group" not in text
    assert_same_run(reference, tmp_path)
