"""Where a load's time goes (checkpoint/load_phases.py, `Checkpointer.last_load_phases`):
a load of either storage format records each of its phases, the reads among them;
the phases fit inside the load's total; a fresh start records only the search; the
summary is logged at debug level; a `phase` outside a recorded load records nothing."""

import logging
import shutil
import sys

from conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, train  # noqa: E402

from disttrain.checkpoint import Checkpointer  # noqa: E402
from disttrain.checkpoint.load_phases import phase, recording, summary  # noqa: E402

EVERY_PHASE = ["find", "targets", "small files", "metadata", "agree", "plan", "reads", "share check",
               "hand over", "total"]
FIXTURE = WORKERS.parent / "data" / "checkpoint_v1"


def _check(phases: dict) -> None:
    assert sorted(phases) == sorted(EVERY_PHASE)
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["reads"] > 0
    assert sum(s for name, s in phases.items() if name != "total") <= phases["total"]


def test_a_load_records_its_phases_and_logs_them(tmp_path, caplog):
    saved = build("ddp")
    train(saved, 1)
    ck = Checkpointer(tmp_path / "run", keep_last=0)
    ck.save(saved)
    loaded = build("ddp")
    with caplog.at_level(logging.DEBUG, logger="disttrain"):
        step_dir = ck.load(loaded)
    _check(ck.last_load_phases)
    assert f"loaded {step_dir.name}, total " in caplog.text and " reads " in caplog.text
    first = ck.last_load_phases
    ck.load(loaded)
    assert ck.last_load_phases is not first  # each load's own record, not a running sum
    ck.close()


def test_a_load_of_the_first_format_records_the_same_phases(tmp_path):
    from test_checkpoint_format import FIXTURE_CFG

    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    ck = Checkpointer(tmp_path / "run", keep_last=0)
    assert ck.load(build("ddp", FIXTURE_CFG, fused=True)) is not None
    _check(ck.last_load_phases)
    ck.close()


def test_a_fresh_start_records_the_search_alone(tmp_path):
    ck = Checkpointer(tmp_path / "empty", keep_last=0)
    assert ck.load(build("ddp")) is None
    assert sorted(ck.last_load_phases) == ["find", "total"]
    ck.close()


def test_a_phase_outside_a_recording_records_nothing():
    with phase("reads"):
        pass
    with recording() as phases:
        with phase("reads"):
            pass
        with phase("reads"):
            pass
    with phase("reads"):
        pass
    assert sorted(phases) == ["reads", "total"] and phases["reads"] <= phases["total"]
    assert summary({"reads": 0.0625, "total": 0.1}) == "total 0.100 s: reads 62 ms"
