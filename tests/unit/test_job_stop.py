"""`elastic.job_stop` on a real in-memory torch store, two notes folders standing for
two nodes: a note that stops the job reaches the other node's folder only when it
carries the job's secret and is a note, a node keeps its own, and a rank that
finished early is known on the other node in its generation only."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from disttrain import worker_notes
from disttrain.elastic import job_stop
from disttrain.elastic.job_store import JobStore
from disttrain.errors import UserError
from disttrain.runtime import failures

SECRET = b"s" * 32


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Two nodes' folders; `on(i)` makes this process a rank of node i."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for f in folders:
        f.mkdir()
    monkeypatch.setenv("LOCAL_RANK", "0")

    def on(i: int):
        monkeypatch.setenv(worker_notes.NOTES_ENV, str(folders[i]))
        return folders[i]

    yield on
    job_stop.share(None)


def test_the_programs_error_on_one_node_is_adopted_by_the_other(nodes):
    store = JobStore(dist.HashStore(), SECRET)
    first = nodes(1)
    job_stop.share(store)
    assert failures.report_program_error(RuntimeError("shapes do not match"), 1, 6)
    job_stop.share(None)
    other = nodes(0)
    assert worker_notes.read_not_retried(other) is None
    assert job_stop.adopt(store)
    assert worker_notes.read_not_retried(other) == worker_notes.read_not_retried(first)
    assert "RuntimeError at step 6 on rank 1" in worker_notes.read_not_retried(other)["line"]


def test_a_user_error_is_adopted_and_a_nodes_own_note_is_kept(nodes):
    store = JobStore(dist.HashStore(), SECRET)
    nodes(1)
    job_stop.share(store)
    worker_notes.write_user_error("job", UserError("the checkpoint folder runs/x is missing"))
    other = nodes(0)
    assert job_stop.adopt(store)
    assert worker_notes.read_user_error(other) == "disttrain job: error: the checkpoint folder runs/x is missing"
    third = nodes(1)  # a node whose own rank failed first keeps its own line
    (third / worker_notes.USER_ERROR).unlink()
    worker_notes.report_not_retried("not retried: its own", 1)
    assert job_stop.adopt(store)
    assert worker_notes.read_user_error(third) is None
    assert worker_notes.read_not_retried(third)["line"] == "not retried: its own"


@pytest.mark.parametrize("value", [
    None,  # written raw, without the job's seal
    '{"kind": "not-retried", "text": "{\\"line\\": \\"x\\", \\"status\\": 0}"}',  # no exit status 0
    '{"kind": "not-retried", "text": "not json"}',
    '{"kind": "finished-rank0-000000", "text": ""}',  # not a note that stops the job
    '["not-retried"]',
    pytest.param("[" * 200_000, id="nested-deeper-than-a-parse-recurses"),
])
def test_what_is_not_a_sealed_stop_note_stops_nothing(nodes, value):
    raw = dist.HashStore()
    store = JobStore(raw, SECRET)
    if value is None:
        raw.set(job_stop.STOP_KEY, '{"kind": "user-error", "text": "disttrain job: error: stop"}')
    else:
        store.set(job_stop.STOP_KEY, value)
    folder = nodes(0)
    assert not job_stop.adopt(store)
    assert list(folder.iterdir()) == []


def test_a_rank_that_finished_is_known_on_the_other_node_in_its_generation(nodes):
    store = JobStore(dist.HashStore(), SECRET)
    nodes(1)
    job_stop.share(store, lambda: 2)
    worker_notes.note_finished(1)
    nodes(0)
    job_stop.adopt_finished(store, 3, 2)  # another generation: nothing
    assert worker_notes.finished_peers(0) == []
    job_stop.adopt_finished(store, 2, 2)
    assert worker_notes.finished_peers(0) == [1]


def _peer(store: JobStore, stops: bool) -> None:
    """The other rank of the generation: it stops the job, or finishes too."""
    if stops:
        job_stop.publish(store, worker_notes.NOT_RETRIED, '{"line": "not retried: peer", "status": 3}')
    else:
        store.set(job_stop.finished_key(0, 1), "")
        store.add(job_stop.finished_key(0, "count"), 1)


@pytest.mark.parametrize("peer_stops", [False, True])
def test_a_finished_rank_waits_for_its_peers_or_their_stop(nodes, monkeypatch, peer_stops):
    """Of a generation of 2 on nodes of one rank: the wait ends when the other rank
    finishes too (no note), or when it stops the job (its note adopted here)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    store = JobStore(dist.HashStore(), SECRET)
    folder = nodes(0)
    job_stop.share(store, lambda: 0)
    worker_notes.note_finished(0)
    timer = threading.Timer(0.2, _peer, (store, peer_stops))
    timer.start()
    job_stop.wait_for_the_others(store, 2, timeout_s=60)
    assert store.add(job_stop.finished_key(0, "count"), 0) == (1 if peer_stops else 2)  # not before
    timer.join()
    note = worker_notes.read_not_retried(folder)
    assert (note is not None and note["status"] == 3) if peer_stops else note is None
