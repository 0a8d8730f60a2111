"""`disttrain run --check`: collectives called on some ranks only, with different shapes,
or while a rank has exited, named with each rank's line before they hang (docs/check.md).

Each bug of tests/workers/check_scripts/collectives.py stops the run with exit 3 and one
message naming every rank's call and line; its correct twin, one call of each collective
kind the checks compare, runs silent. A rank missing past the bound is one warning and
the checks stop on every rank: shown in one process, on a store of the test's own.
"""

import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import WORKERS, run_checked, script_line

from disttrain.check import fingerprints
from disttrain.check.collective_watch import WORLD, CollectiveWatch
from disttrain.check.fingerprints import STEP, Event
from disttrain.check.sequence import OFF, PREFIX, Sequence, wait_bound_s
from disttrain.check.verdicts import Report
from disttrain.runtime.log import LOGGER

SCRIPT = WORKERS / "check_scripts" / "collectives.py"
JOB_TIMEOUT = 120


def line_of(text: str) -> str:
    return script_line(SCRIPT, text)


BUGS = {
    # bug -> (the words of the message, each rank's line)
    "one_rank": (
        ["before the first optimizer step", "rank 0 calls all_reduce (tensor float32 [], op SUM)",
         "rank 1 steps the optimizer", "runs on rank 0 only (under a rank condition?) and would hang"],
        ["dist.all_reduce(loss.detach()", "optimizer.step()"],
    ),
    "shapes": (
        ["after 4 optimizer steps", "rank 0 calls all_reduce (tensor float32 [3], op MAX)",
         "rank 1 calls all_reduce (tensor float32 [4], op MAX)", "the ranks' all_reduce arguments differ"],
        ["dist.all_reduce(counts"],
    ),
    "early_exit": (
        ["rank 0 calls all_reduce (tensor float32 [1])", "rank 1 has called sys.exit(0)",
         "runs on rank 0 only, and rank 1 will never join it"],
        ["dist.all_reduce(total)", "sys.exit(0)"],
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_collective_bug_stops_the_run_naming_each_ranks_line(bug):
    words, lines = BUGS[bug]
    proc = run_checked(SCRIPT, "--bug", bug, timeout=JOB_TIMEOUT)
    assert proc.returncode == 3, proc.stderr[-3000:]
    for text in [*words, *(line_of(line) for line in lines)]:
        assert text in proc.stderr, (text, proc.stderr[-3000:])
    assert proc.stderr.count("--check stopped the run") == 1 and "Traceback" not in proc.stderr


def test_every_collective_kind_called_correctly_runs_silent():
    """Also what differs by design: all_to_all_single's splits, gather and scatter lists on
    the root only, the same broadcast from two lines, a group of its own, the end by
    destroy_process_group()."""
    proc = run_checked(SCRIPT, timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr and "stopped" not in proc.stderr, proc.stderr[-3000:]
    assert "no problem found" in proc.stderr, proc.stderr[-3000:]
    note = proc.stderr.split("collectives: ")[1].split(";")[0]
    assert note.endswith("and 4 optimizer steps matched across ranks"), note
    called = note.split("(")[1].split(")")[0].split(", ")
    for op in ("all_gather", "all_gather_object", "all_reduce", "all_to_all_single", "barrier", "broadcast",
               "broadcast_object_list", "gather", "reduce", "scatter"):
        assert op in called, (op, note)


def test_what_differs_by_design_matches_and_the_rest_does_not():
    t = torch.zeros(3)

    def event(function, line="a.py:1", **arguments):
        return fingerprints.collective(function, arguments, line)

    same = [event("all_to_all_single", output=torch.zeros(2), input=t, input_split_sizes=[1, 2]),
            event("all_to_all_single", "a.py:9", output=t, input=torch.zeros(5), input_split_sizes=[2, 3])]
    assert fingerprints.mismatch_text(same, [0, 1], "here") is None
    ops = [event("all_reduce", tensor=t, op=dist.ReduceOp.SUM), event("all_reduce", tensor=t, op=dist.ReduceOp.MAX)]
    assert "op MAX" in fingerprints.mismatch_text(ops, [0, 1], "here")
    order = [event("barrier", "a.py:3"), event("broadcast", "a.py:4", tensor=t, src=0)]
    text = fingerprints.mismatch_text(order, [0, 1], "here")
    assert "rank 0 calls barrier at a.py:3; rank 1 calls broadcast (tensor float32 [3], src 0) at a.py:4" in text
    assert "in the same order" in text
    assert wait_bound_s({}) == 60.0 and wait_bound_s({"DISTTRAIN_CHECK_WAIT_S": "x"}) == 60.0


def test_a_rank_missing_past_the_bound_is_one_warning_and_every_rank_stops_comparing():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def sequence(rank):
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=0.3))
        return Sequence(rank, 0.3, dist.PrefixStore(PREFIX, client))

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    LOGGER.addHandler(handler)
    try:
        watch = CollectiveWatch(Report(), window=50)
        watch.sequence, watch.active = sequence(1), True
        watch.exchange(WORLD, [0, 1], Event(STEP, line="train.py:9"))
    finally:
        LOGGER.removeHandler(handler)
    (record,) = records
    assert "rank 1 steps the optimizer at train.py:9 and has waited 0.3 s for rank 0" in record.getMessage()
    assert "rank 0 has made no call yet" in record.getMessage() and not watch.active
    # rank 0 comes late: it matches rank 1's event, then finds rank 1 stopped comparing
    late = sequence(0)
    assert late.exchange(WORLD, [0, 1], Event(STEP).to_json().encode()) == [Event(STEP), Event(STEP, line="train.py:9")]
    assert late.exchange(WORLD, [0, 1], OFF) is None
