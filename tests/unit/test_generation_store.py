"""`elastic.generation_store` on a real c10d TCP store standing for the job's etcd: a
generation's rank 0 hosts the store its groups meet on and the others reach it, and
where the other nodes could not reach it, or what rank 0 published is not an address,
nothing is connected to a wrong place."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from disttrain.elastic import etcd_store, generation_store, liveness
from disttrain.elastic.job_store import JobStore
from disttrain.launch.etcd_server import free_port

SECRET = b"\x5a" * 32


@pytest.fixture
def job(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv(etcd_store.STORE_ENV, f"etcd://127.0.0.1:{port}")  # the job's store "is the etcd"
    yield JobStore(server, SECRET)
    generation_store._HOSTED.clear()
    liveness._PUBLISHED.clear()  # each test's slots are new ones


def _both(job: JobStore, gen: int, slots: list[int]) -> list[dist.Store]:
    """Ranks 0 and 1 of generation `gen` asking at once, as two processes would."""
    got: dict[int, dist.Store] = {}
    other = threading.Thread(target=lambda: got.setdefault(1, generation_store.for_generation(job, gen, 1, slots, 10)))
    other.start()
    got[0] = generation_store.for_generation(job, gen, 0, slots, 10)
    other.join(timeout=20)
    return [got[0], got[1]]


def test_rank_0_hosts_the_generations_store_and_the_others_reach_it(job):
    for slot in (0, 1):
        job.set(liveness.KEY.format(slot=slot), f"127.0.0.1:{1000 + slot} {liveness.here()}")  # both here
    hosted, joined = _both(job, 3, [0, 1])
    assert hosted is not job.store and joined is not job.store
    hosted.set("x", "from rank 0")
    assert joined.get("x") == b"from rank 0"
    assert not job.store.check(["x"])  # the groups' keys stay off the job's store


@pytest.mark.parametrize("other", ["10.1.2.3:1000 another-host/1", "127.0.0.1:1000 another-host/1"],
                         ids=["routable", "its-own-localhost"])
def test_a_loopback_rank_0_with_a_member_on_another_node_keeps_the_etcd(job, other):
    job.set(liveness.KEY.format(slot=0), f"127.0.0.1:1000 {liveness.here()}")
    job.set(liveness.KEY.format(slot=1), other)  # that node reaches the etcd by another address, or its own proxy
    assert _both(job, 1, [0, 1]) == [job.store, job.store]


def test_without_the_etcd_the_jobs_own_store_is_used(job, monkeypatch):
    monkeypatch.delenv(etcd_store.STORE_ENV)
    assert generation_store.for_generation(job, 1, 1, [0, 1], 1) is job.store


@pytest.mark.parametrize("value", ["no-port", "127.0.0.1:0", "127.0.0.1:99999", "x" * 400 + ":80"])
def test_a_published_value_that_is_not_an_address_is_refused(job, value):
    job.set(generation_store.KEY.format(gen=2), value)
    with pytest.raises(ValueError, match="published no address"):
        generation_store.for_generation(job, 2, 1, [0, 1], 5)


def test_a_value_without_the_jobs_seal_is_not_taken_for_rank_0s(job):
    JobStore(job.store, b"\x01" * 32).set(generation_store.KEY.format(gen=4), "127.0.0.1:1")
    with pytest.raises(TimeoutError, match="rank 0 did not say where"):
        generation_store.for_generation(job, 4, 1, [0, 1], 0.3)
