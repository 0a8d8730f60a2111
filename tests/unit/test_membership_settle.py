"""`elastic.membership.settle` on a real c10d TCP store: the survivors of a generation
agree on its roster, once per loss, and a member found gone after the roster was
decided (it died while the others waited) is dropped by a second round instead of
holding the generation until its timeout."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from disttrain.elastic import membership
from disttrain.elastic.job_store import JobStore
from disttrain.launch.etcd_server import free_port

GEN_KEY = "disttrain/fast/gen"


@pytest.fixture
def job():
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    return JobStore(server, b"\x3c" * 32)


def _at_once(job: JobStore, calls: list[tuple]) -> list[list[int]]:
    """Each of `calls` (settle's arguments after the store) from a thread of its own, all
    started together, as the survivors' processes would."""
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i, a=a: got.setdefault(i, membership.settle(job, *a)))
               for i, a in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    return [got[i] for i in range(len(calls))]


def test_survivors_that_settle_the_same_loss_at_once_agree_and_count_it_once(job):
    rosters = _at_once(job, [(3, [0, 1, 2, 3], [3], GEN_KEY)] * 3)
    assert rosters == [[0, 1, 2]] * 3
    assert membership.decided(job, 3) == [0, 1, 2] and membership.gone(job) == [3]
    assert job.add(membership.LOST_KEY, 0) == 1
    assert job.add(GEN_KEY, 0) == 3  # the survivors' generation, which no newcomer bumped


def test_a_member_lost_after_the_roster_was_decided_is_dropped_by_a_second_round(job):
    assert membership.settle(job, 2, [0, 1, 2, 3], [3], GEN_KEY) == [0, 1, 2]
    # A late survivor of the first loss reads the first round's roster.
    assert membership.settle(job, 2, [0, 1, 2, 3], [3], GEN_KEY) == [0, 1, 2]
    # Slot 2 dies while the others wait: its loss is a round of its own, decided once.
    rosters = _at_once(job, [(2, [0, 1, 2], [2], GEN_KEY)] * 2)
    assert rosters == [[0, 1]] * 2
    assert membership.decided(job, 2) == [0, 1] and membership.roster(job, 4) == [0, 1]
    assert membership.gone(job) == [2, 3] and job.add(membership.LOST_KEY, 0) == 2


def test_a_survivor_that_saw_both_losses_at_once_counts_the_first_once(job):
    """One survivor settles slot 3; another, which saw slots 2 and 3 missing, comes
    later with the generation's first roster: only slot 2 is a new loss."""
    assert membership.settle(job, 4, [0, 1, 2, 3], [3], GEN_KEY) == [0, 1, 2]
    assert membership.settle(job, 4, [0, 1, 2, 3], [2, 3], GEN_KEY) == [0, 1]
    assert job.add(membership.LOST_KEY, 0) == 2 and membership.gone(job) == [2, 3]


def test_a_second_round_gives_a_lost_place_to_a_standby_slot(job):
    assert membership.settle(job, 1, [0, 1, 2, 3], [2, 3], GEN_KEY, standby=[4, 5]) == [0, 1, 4, 5]
    assert membership.settle(job, 1, [0, 1, 4, 5], [5], GEN_KEY, standby=[6]) == [0, 1, 4, 6]
    assert membership.settle(job, 1, [0, 1, 4, 6], [6], GEN_KEY) == [0, 1, 4]
    assert job.add(membership.LOST_KEY, 0) == 1  # one place dropped in all: the spares took the others
