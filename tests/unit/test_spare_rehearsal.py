"""A warm spare's rehearsal of its first sharded step (`train.spare_rehearsal`): it
leaves nothing behind but torch's sharding plans, and a spare promoted to another place
than it rehearsed computes and saves exactly as one that rehearsed its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import launch_worker, worker_env

from disttrain.config import Config
from disttrain.config.schema import ElasticConfig, ParallelConfig, TrainConfig
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
    (ParallelConfig(strategy="fsdp", device="cpu", tp=2), TrainConfig(), False),  # TP's subgroups: unproven
    (ParallelConfig(strategy="fsdp", device="cpu"), TrainConfig(compile=True), False),
    (ParallelConfig(strategy="fsdp", device="cuda"), TrainConfig(), False),  # the GPU is the trainer's
])
def test_a_spare_rehearses_only_fsdp_steps_on_the_cpu(parallel, train, wanted):
    assert pays(Config(parallel=parallel, train=train)) is wanted
    assert pays(Config(parallel=parallel, train=train, elastic=ElasticConfig(rehearse_spares=False))) is False


STANDING_BY = """
import sys, time
from disttrain.elastic import fast_recovery, promotion_wait
promotion_wait.CALM_S = 0.1
done = []
def standby():
    print("standing by", flush=True)
    for _ in range(3000):  # 30 s of work unless a promotion cuts it short
        time.sleep(0.01)
    done.append(True)
fast_recovery.wait_for_promotion(standby)
print(f"promoted: {fast_recovery.os.environ[fast_recovery.ROLE_ENV]}, standby finished: {bool(done)}", flush=True)
"""


def _promoted_after(script: str, line: str) -> str:
    """Run a spare's `script`; once it prints `line`, promote it (one line on its input,
    as its supervisor does); return what it printed after, well within the 30 s its
    standby work would take."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=worker_env())
    try:
        assert proc.stdout.readline().strip() == line
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    return out.strip()


def test_a_promotion_during_the_standby_work_cuts_it_short():
    """A spare rehearsing when its slot's process dies must take over at once, not after
    the rehearsal: the line on its input interrupts the work, and is still read."""
    assert _promoted_after(STANDING_BY, "standing by") == "promoted: newcomer, standby finished: False"


PROMOTED_IN_TEARDOWN = """
import sys, time
import torch.distributed as dist
from disttrain.elastic import fast_recovery, promotion_wait
from disttrain.train import spare_rehearsal
promotion_wait.CALM_S = 0.1
destroy = dist.destroy_process_group
def slow_destroy(*args, **kwargs):  # the promotion arrives while the group is destroyed
    print("destroying", flush=True)
    time.sleep(1.0)
    destroy(*args, **kwargs)
dist.destroy_process_group = slow_destroy
def standby():
    with spare_rehearsal.fake_world(1, 2):
        pass
    time.sleep(30)  # the rest of the standby work, which the promotion cuts short
fast_recovery.wait_for_promotion(standby)
print(f"a group left behind: {dist.is_initialized()}", flush=True)
"""


def test_a_promotion_while_the_rehearsals_group_is_destroyed_leaves_no_group_behind():
    """A promotion that comes while the rehearsal's fake group is being destroyed waits
    for the destroy: a fake default group left behind would be taken for the real one
    (`runtime.init` starts none when one exists), and the generation would wait for this
    rank forever."""
    assert _promoted_after(PROMOTED_IN_TEARDOWN, "destroying") == "a group left behind: False"
