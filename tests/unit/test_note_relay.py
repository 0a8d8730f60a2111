"""`elastic.note_relay` on a real c10d TCP store standing for the rendezvous' store, two
notes folders for two nodes' launchers: a node's stop note reaches the other launcher's
folder only when both hold the job's secret, only for the same run and round, and a
value that someone without the secret wrote there is never adopted."""

from __future__ import annotations

import datetime
import json

import pytest
import torch.distributed as dist

from disttrain import worker_notes
from disttrain.elastic import note_relay
from disttrain.elastic.note_relay import Where as Seen
from disttrain.launch.etcd_server import free_port
from disttrain.runtime import job_secret

NOTE = json.dumps({"line": "not retried: RuntimeError at step 6 on rank 1 is the program's error", "status": 1,
                   "traceback": "Traceback (most recent call last):\nRuntimeError: boom\n"})


@pytest.fixture
def rendezvous():
    """A c10d store serving as the rendezvous' (torchrun's agent hosts one at the endpoint)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server, (lambda round_="host_1234", run_id="job": Seen("c10d", f"127.0.0.1:{port}", run_id, round_))


def test_the_note_of_one_node_is_adopted_by_the_other_with_the_secret(rendezvous, tmp_path, monkeypatch):
    _, seen = rendezvous
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)
    note_relay.publish(seen(), (worker_notes.NOT_RETRIED, NOTE))
    assert not note_relay.adopt(seen(round_="host_999"), str(tmp_path))  # another round: not this job's stop
    assert not note_relay.adopt(seen(run_id="other"), str(tmp_path))
    assert note_relay.adopt(seen(), str(tmp_path))
    assert worker_notes.read_not_retried(tmp_path) == json.loads(NOTE)


def test_a_note_sealed_with_another_secret_or_unsealed_is_not_adopted(rendezvous, tmp_path, monkeypatch):
    server, seen = rendezvous
    monkeypatch.setenv(job_secret.SECRET_ENV, "cd" * 32)
    note_relay.publish(seen(), (worker_notes.NOT_RETRIED, NOTE))
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)
    assert not note_relay.adopt(seen(), str(tmp_path))
    # a client without the secret writes a plausible value where the note goes
    server.set("disttrain/stopped/job/host_1234/disttrain/fast/stop",
               json.dumps({"kind": worker_notes.NOT_RETRIED, "text": NOTE}))
    assert not note_relay.adopt(seen(), str(tmp_path))
    assert worker_notes.read_stop(tmp_path) is None


def test_without_a_secret_nothing_is_written_or_read(rendezvous, tmp_path, monkeypatch):
    server, seen = rendezvous
    monkeypatch.delenv(job_secret.SECRET_ENV, raising=False)
    note_relay.publish(seen(), (worker_notes.NOT_RETRIED, NOTE))
    assert not server.check(["disttrain/stopped/job/host_1234/disttrain/fast/stop"])
    assert not note_relay.adopt(seen(), str(tmp_path))


def test_an_unreachable_store_or_no_round_is_no_note(tmp_path, monkeypatch):
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)
    gone = Seen("c10d", f"127.0.0.1:{free_port()}", "job", "host_1")
    note_relay.publish(gone, (worker_notes.NOT_RETRIED, NOTE))  # logged, not raised: the node stops anyway
    assert not note_relay.adopt(gone, str(tmp_path))
    assert not note_relay.adopt(Seen("c10d", "127.0.0.1:1", "job", None), str(tmp_path))
    assert not note_relay.adopt(Seen("static", None, "job", "host_1"), str(tmp_path))


def test_a_worker_adopts_the_note_of_its_round_into_its_nodes_notes(rendezvous, tmp_path, monkeypatch):
    """A rank whose collective failed reads the round it is in from its launcher's
    `RELAY_ENV` and its MASTER_ADDR and MASTER_PORT, and copies the note into its own
    node's notes (then exits quietly: its launcher prints the note)."""
    _, seen = rendezvous
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)
    note_relay.publish(seen(round_="10.0.0.1_29500"), (worker_notes.USER_ERROR, "disttrain: bad config"))
    monkeypatch.setenv(worker_notes.NOTES_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29501")  # another round: not adopted
    monkeypatch.setenv(note_relay.RELAY_ENV, note_relay.for_workers(seen()))
    assert not note_relay.adopt_in_worker()
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert note_relay.adopt_in_worker()
    assert worker_notes.read_user_error(tmp_path) == "disttrain: bad config"
    for value in ("not json", "5", '["etcd-v2", null]'):
        monkeypatch.setenv(note_relay.RELAY_ENV, value)
        assert not note_relay.adopt_in_worker()


def test_a_rank_that_finished_on_one_node_is_known_on_the_other(rendezvous, tmp_path, monkeypatch):
    """A worker of a job that relays shares its finish on its round's store; a worker of
    the other node whose collective failed copies it, and so names the early finish
    instead of a lost peer. Nothing that stops the job is adopted by it."""
    _, seen = rendezvous
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    for name, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500"),
                        ("WORLD_SIZE", "2"), (job_secret.SECRET_ENV, "ab" * 32),
                        (note_relay.RELAY_ENV, note_relay.for_workers(seen()))):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(worker_notes.NOTES_ENV, str(node1))
    note_relay.share_from_worker()
    try:
        worker_notes.note_finished(1)
    finally:
        worker_notes.share_stops(None)
    monkeypatch.setenv(worker_notes.NOTES_ENV, str(node0))
    assert worker_notes.finished_peers(0) == []
    assert not note_relay.adopt_in_worker()  # a finish is not a stop
    assert worker_notes.finished_peers(0) == [1]
