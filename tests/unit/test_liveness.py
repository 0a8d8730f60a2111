"""`elastic.liveness` and the membership watch that uses it, on a real c10d TCP store
standing for the job's store and real processes standing for slot supervisors: a
supervisor killed with its process tree is known gone at once, one that lives is not,
and nothing a probe cannot prove (no address, another secret's address, no answer)
decides anything: the lease does."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from disttrain.elastic import liveness, membership
from disttrain.elastic.job_store import JobStore
from disttrain.launch.etcd_server import free_port

SECRET = b"\xab" * 32

SUPERVISOR = textwrap.dedent(
    """
    import datetime, sys, time
    import torch.distributed as dist
    from disttrain.elastic import liveness
    from disttrain.elastic.job_store import JobStore
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=10))
    assert liveness.listen(JobStore(store, b"\\xab" * 32), int(sys.argv[2]))
    print("listening", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def store(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("DISTTRAIN_FAST_STORE", raising=False)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield port, JobStore(server, SECRET)
    liveness._PUBLISHED.clear()  # each test's slots are new ones
    liveness._SEEN_ALIVE.clear()


def _supervisor(port: int, slot: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(port), str(slot)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    return proc


LISTENER = textwrap.dedent(
    """
    import socket, time
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    while True:
        sock.accept()[0].close()
    """
)


def _listener(job: JobStore, slot: int) -> subprocess.Popen:
    """A process standing for a supervisor that `listen`ed (no torch to import): its port
    published for `slot` as `listen` would."""
    proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    job.set(liveness.KEY.format(slot=slot), f"127.0.0.1:{int(proc.stdout.readline())} {liveness.here()}")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_supervisor_is_alive_while_it_runs_and_gone_once_killed(store):
    port, job = store
    procs = [_supervisor(port, 0), _supervisor(port, 1)]
    try:
        assert liveness.probe(job, [0, 1, 2]) == {0: liveness.ALIVE, 1: liveness.ALIVE, 2: None}
        _kill(procs[1])
        assert liveness.probe(job, [0, 1]) == {0: liveness.ALIVE, 1: liveness.GONE}
    finally:
        for proc in procs:
            proc.kill()


def test_an_address_that_does_not_carry_the_secret_or_does_not_parse_decides_nothing(store):
    _, job = store
    proc = _listener(job, 3)
    try:
        where = job.get(liveness.KEY.format(slot=3))
        assert liveness.probe(job, [3]) == {3: liveness.ALIVE}
        _kill(proc)
        # another secret's value names the same (now refused) address
        JobStore(job.store, b"\xcd" * 32).set(liveness.KEY.format(slot=0), where)
        job.set(liveness.KEY.format(slot=1), f"127.0.0.1:99999 {liveness.here()}")
        job.set(liveness.KEY.format(slot=2), "x" * (liveness.MAX_ADDRESS + 1))
        assert liveness.probe(job, [0, 1, 2, 3]) == {0: None, 1: None, 2: None, 3: liveness.GONE}
    finally:
        proc.kill()


def test_a_refusal_from_an_address_never_seen_alive_decides_nothing(store):
    _, job = store
    job.set(liveness.KEY.format(slot=0), f"127.0.0.1:{free_port()} {liveness.here()}")  # as behind a firewall
    assert liveness.probe(job, [0]) == {0: None}


def test_no_answer_within_the_timeout_decides_nothing(store):
    _, job = store
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)  # never accepts: once its queue is full, the kernel drops further connections
    job.set(liveness.KEY.format(slot=0), f"127.0.0.1:{silent.getsockname()[1]} {liveness.here()}")
    held = []
    try:
        assert liveness.probe(job, [0]) == {0: liveness.ALIVE}
        for _ in range(4):  # fill the queue
            held.append(socket.socket())
            held[-1].setblocking(False)
            held[-1].connect_ex(silent.getsockname())
        time.sleep(0.2)
        assert liveness.probe(job, [0], timeout_s=0.3) == {0: None}
    finally:
        for sock in [*held, silent]:
            sock.close()


def _lost_within(watch: membership.Watch, seconds: float) -> list[int] | None:
    """What `watch.lost()` says first within `seconds` (None if nothing by then)."""
    deadline = time.monotonic() + seconds
    while (lost := watch.lost()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return lost


def _beat_once(job: JobStore, *slots: int) -> None:
    for slot in slots:
        job.add(f"disttrain/fast/alive/{slot}", 1)


def test_the_watch_takes_a_killed_node_for_lost_before_its_lease(store, monkeypatch):
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "30")  # a lease no test waits for
    procs = [_listener(job, s) for s in (0, 1, 2, 3, 4)]  # slots 0-3 train, 4 stands by
    try:
        _beat_once(job, 0, 1, 2, 3, 4)
        liveness.probe(job, [0, 1, 2, 3, 4])  # every rank's first look in a generation (`confirm`)
        membership.arrive(job, 1, 0)
        membership.arrive(job, 1, 1)
        _kill(procs[2])
        _kill(procs[3])
        watch = membership.Watch(job, 1, [0, 1, 2, 3], standby=[4])
        assert watch.lost() == [2, 3]
        assert watch.fresh == [4]
        # a missing member whose supervisor lives (its spare is coming): the lease decides
        live = membership.Watch(job, 1, [0, 1, 4], standby=[])
        assert live.lost() is None
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.parametrize(("beaten", "standby"), [
    ((0, 1, 2), [2]),  # a standby slot whose machine says nothing: which slots are fresh is unknown
    ((0,), []),  # the killed member never beat: it may not have started yet
], ids=["silent-standby", "never-beat"])
def test_the_lease_decides_what_a_probe_cannot(store, monkeypatch, beaten, standby):
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "30")
    proc = _listener(job, 1)
    try:
        _beat_once(job, *beaten)
        liveness.probe(job, [1])
        membership.arrive(job, 1, 0)
        _kill(proc)
        job.set(liveness.KEY.format(slot=2), "192.0.2.1:9 elsewhere")  # TEST-NET-1: no host of the job there
        assert membership.Watch(job, 1, [0, 1], standby=standby).lost() is None
    finally:
        proc.kill()


def test_when_the_lease_decides_its_line_says_what_the_probes_found(store, monkeypatch):
    """A user who waited a lease for a lost node learns why no probe decided sooner."""
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "0.3")
    _beat_once(job, 0, 1, 2)
    membership.arrive(job, 1, 0)
    closed = free_port()
    job.set(liveness.KEY.format(slot=1), f"127.0.0.1:{closed} {liveness.here()}")  # refused, never seen to accept
    watch = membership.Watch(job, 1, [0, 1, 2])
    assert _lost_within(watch, 10) == [1, 2] and not watch.refused
    cause = watch.cause()
    assert cause.startswith("no beat for 0.3 s: a node is gone")
    assert f"rank 1: 127.0.0.1:{closed}: Connection refused, never seen to accept" in cause
    assert "rank 2: no address of it is on the store" in cause
    line = membership.settled_words([0, 1, 2], [1, 2], [0], 1, cause)
    assert line.startswith("rank(s) [1, 2] lost with their supervisors (no beat for 0.3 s") and "world 1" in line


def test_a_loopback_address_of_another_place_is_never_probed(store):
    """Every node reaching an etcd proxy on its own `localhost` publishes a loopback
    address: from another host that address would lead to this host's own port."""
    _, job = store
    proc = _listener(job, 0)
    try:
        here = job.get(liveness.KEY.format(slot=0))
        job.set(liveness.KEY.format(slot=1), here.replace(liveness.here(), "another-host/4026531840"))
        assert liveness.probe(job, [0, 1]) == {0: liveness.ALIVE, 1: None}
    finally:
        proc.kill()


def test_a_supervisor_that_dies_after_the_watch_began_is_found_before_the_lease(store, monkeypatch):
    """A node's processes do not all die at once: the watch probes again while it waits."""
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "30")
    procs = [_listener(job, s) for s in (0, 1)]
    try:
        _beat_once(job, 0, 1)
        liveness.probe(job, [0, 1])
        membership.arrive(job, 1, 0)
        watch = membership.Watch(job, 1, [0, 1])
        assert watch.lost() is None  # slot 1's supervisor still runs
        _kill(procs[1])
        lost = _lost_within(watch, 10)
        assert lost == [1] and watch.refused
    finally:
        for proc in procs:
            proc.kill()


def test_a_probe_never_settles_some_of_the_missing_members_only(store, monkeypatch):
    """A generation's roster is settled once: while one missing member's supervisor still
    runs, a dead one beside it is not dropped alone (both go once both are refused)."""
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "30")
    procs = [_listener(job, s) for s in (0, 1, 2)]
    try:
        _beat_once(job, 0, 1, 2)
        liveness.probe(job, [0, 1, 2])
        membership.arrive(job, 1, 0)
        _kill(procs[1])
        watch = membership.Watch(job, 1, [0, 1, 2])
        for _ in range(5):
            assert watch.lost() is None
            time.sleep(membership.REPROBE_S)
        _kill(procs[2])
        lost = _lost_within(watch, 10)
        assert lost == [1, 2]
    finally:
        for proc in procs:
            proc.kill()


def test_a_member_that_arrives_during_the_watch_does_not_hold_back_the_probes(store, monkeypatch):
    """A slow survivor missing when the watch began, alive, then arrived: the dead member
    beside it is still found by a probe, before the lease."""
    _, job = store
    monkeypatch.setenv(membership.LEASE_ENV, "30")
    procs = [_listener(job, s) for s in (0, 1, 2)]
    try:
        _beat_once(job, 0, 1, 2)
        liveness.probe(job, [0, 1, 2])
        membership.arrive(job, 1, 0)
        _kill(procs[2])
        watch = membership.Watch(job, 1, [0, 1, 2])  # slot 1 still recovering: alive, not yet in
        assert watch.lost() is None
        membership.arrive(job, 1, 1)
        lost = _lost_within(watch, 10)
        assert lost == [2] and watch.refused
    finally:
        for proc in procs:
            proc.kill()


def test_a_supervisor_that_listens_after_the_generation_began_is_confirmed_later(store, monkeypatch):
    """At a job's start a rank may look before another node's supervisor has published its
    address: `confirm` looks again, so that node's later loss is still found by a probe."""
    _, job = store
    monkeypatch.setattr(liveness, "CONFIRM_EVERY_S", 0.05)
    liveness.confirm(job, [1])  # nothing published yet
    time.sleep(0.2)
    proc = _listener(job, 1)
    try:
        deadline = time.monotonic() + 10
        while not liveness._SEEN_ALIVE and time.monotonic() < deadline:
            time.sleep(0.02)
        _kill(proc)
        assert liveness.probe(job, [1]) == {1: liveness.GONE}
    finally:
        proc.kill()
