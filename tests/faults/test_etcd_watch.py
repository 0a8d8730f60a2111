"""A standby slot waits for the roster with one etcd watch (`EtcdStore.wait_for_change`,
`membership.await_roster`), on a real etcd: it wakes on a change made by another
client, including one made between its read and its watch, and returns False when
nothing changed."""

from __future__ import annotations

import json
import threading

import pytest

from disttrain.elastic import etcd_store, membership
from disttrain.elastic.job_store import JobStore
from disttrain.launch.etcd_server import EtcdServer

SECRET = b"\x3c" * 32


@pytest.fixture(scope="module")
def endpoint():
    with EtcdServer().start() as server:
        yield server.endpoint


def _clients(endpoint: str, prefix: str) -> tuple[JobStore, JobStore]:
    """A standby slot's store and a training rank's, in one job's directory."""
    return tuple(JobStore(etcd_store.connect(endpoint, 10, prefix=prefix), SECRET) for _ in range(2))


def test_a_roster_written_between_the_read_and_the_watch_wakes_the_watch(endpoint):
    standby, rank0 = _clients(endpoint, "watch/between")
    assert membership.roster(standby, 2) == [0, 1]  # no roster yet: the first world's slots
    rank0.set(membership.ROSTER_KEY, json.dumps([0, 2]))  # a settle, before the standby watches
    # A watch from "now" would wait the whole limit and say False.
    assert standby.store.wait_for_change(membership.ROSTER_KEY, 3.0) is True
    assert membership.roster(standby, 2) == [0, 2]


def test_a_watch_returns_on_another_clients_write_and_says_when_nothing_changed(endpoint):
    standby, rank0 = _clients(endpoint, "watch/later")
    rank0.set(membership.ROSTER_KEY, json.dumps([0, 1]))
    assert membership.roster(standby, 2) == [0, 1]
    rank0.set("disttrain/fast/other", "x")  # another key's write is not the roster's change
    assert standby.store.wait_for_change(membership.ROSTER_KEY, 0.3) is False
    writer = threading.Timer(0.2, lambda: rank0.set(membership.ROSTER_KEY, json.dumps([0, 1, 2, 3])))
    writer.start()
    try:
        assert standby.store.wait_for_change(membership.ROSTER_KEY, 30.0) is True
    finally:
        writer.join()
    assert membership.roster(standby, 2) == [0, 1, 2, 3]


def test_a_removed_roster_directory_wakes_the_watch(endpoint):
    """The last slot out removes the round's keys (`EtcdStore.remove_all`): a standby slot
    then reads the job's end at once, not after its poll."""
    standby, rank0 = _clients(endpoint, "watch/removed/round")
    rank0.set(membership.ROSTER_KEY, json.dumps([0, 1]))
    membership.roster(standby, 2)
    rank0.store.remove_all()
    assert standby.store.wait_for_change(membership.ROSTER_KEY, 3.0) is True
    assert standby.get(membership.ROSTER_KEY) is None
