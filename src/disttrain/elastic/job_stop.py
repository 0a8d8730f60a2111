"""A stop that holds for every node of a fast-recovery job. A rank's user error or
failure that is not retried (`worker_notes`) is written to its own node's notes
folder, which only that node's launcher reads; so is a rank's code that ended while
its peers still train (a `break` on one rank). Without more, the other nodes would
see only a node whose supervisors stopped beating (its launcher stopped it), take it
for lost, shrink in memory and finish with exit 0, while the job had failed.

So these notes also go onto the job's store (`share`, sealed with the job's secret:
`elastic.job_store`), before they are written to their node's folder, so they are
there before that node's launcher acts on them:
- a stop (`STOP_KEY`): a rank of another node reads it before it calls a failed
  collective a lost peer, and before a generation drops a node (`fast_recovery`); a
  standby slot reads it as it polls (`slot_supervisor`). It copies the note into its
  own node's folder (`adopt`): that node's launcher stops its node with the same line
  and exit status, and its ranks whose collectives failed exit quietly, as on the node
  that failed;
- a finished rank (`finished_key`): a rank whose collective failed copies it before
  it looks for a peer that ended early (`adopt_finished`). The rank that finished cuts
  its groups' connections (as its exit would) and waits, before it counts itself out,
  until every rank of its generation has finished too or the job was stopped
  (`wait_for_the_others`): its node's launcher must say the stop its peers'
  early-finish line makes, not exit 0 (or wait at torchrun's exit barrier).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from disttrain import json_text, worker_notes
from disttrain.elastic import group_sockets
from disttrain.elastic.job_store import JobStore

STOP_KEY = "disttrain/fast/stop"
MAX_NOTE_CHARS = 1 << 20
"""A note on the store longer than this is not adopted (`worker_notes` keeps a
traceback's last `worker_notes.MAX_TRACEBACK_CHARS`)."""
POLL_S = 0.02
_FINISHED: list[int] = []
"""The generation in which this process's rank said its code finished (`share`)."""


def finished_key(gen: int, rank: int | str) -> str:
    """Rank `rank`'s finish in generation `gen` ("count": how many ranks finished)."""
    return f"disttrain/fast/g{gen}/finished/{rank}"


def share(store: JobStore | None, generation: Callable[[], int] = lambda: 0) -> None:
    """From now on, this process's notes that stop the job, and its rank's finish in
    generation `generation()`, are written to `store` too, before its node's folder
    (`worker_notes.share_stops`); `share(None)`: no longer (the job's keys may be gone)."""
    _FINISHED.clear()
    worker_notes.share_stops(None if store is None else functools.partial(send, store, generation))


def send(store: JobStore, generation: Callable[[], int], kind: str, text: str) -> None:
    """Write one note of `worker_notes.share_stops` to `store`: a note that stops the job
    (`publish`), or this rank's finish in generation `generation()`."""
    if kind != worker_notes.FINISHED:
        publish(store, kind, text)
        return
    gen = generation()
    store.set(finished_key(gen, int(text)), "")
    store.add(finished_key(gen, "count"), 1)
    _FINISHED[:] = [gen]


def publish(store: JobStore, kind: str, text: str) -> None:
    """Put a note that stops the job (`worker_notes.share_stops`'s `kind` and `text`) on
    `store`; the newest wins (two nodes that fail at once each keep their own)."""
    store.set(STOP_KEY, json.dumps({"kind": kind, "text": text}))


def adopt(store: JobStore, folder: Path | None = None) -> bool:
    """Whether a rank of the job stopped it (a note on `store`): the note is then copied
    into this node's folder (this launch's, or `folder` in the launcher itself), for its
    launcher, unless this node has one of its own.
    False when the store cannot be read (the node that hosted it is gone: what happens
    next is the caller's, as before this check)."""
    try:
        text = store.get(STOP_KEY)
    except (RuntimeError, ConnectionError, TimeoutError, OSError):  # torch's DistNetworkError among them
        return False
    record = json_text.loads_object(text) if text is not None and len(text) <= MAX_NOTE_CHARS else None
    if record is None or not isinstance(record.get("text"), str):
        return False
    return worker_notes.adopt_stop(str(record.get("kind")), record["text"], folder)


def adopt_finished(store: JobStore, gen: int, world: int) -> None:
    """Copy into this node's folder the ranks of generation `gen` (of `world`) whose code
    finished on another node (`worker_notes.finished_peers` then names them)."""
    try:  # one read in a recovery where no rank finished (the usual one)
        if store.add(finished_key(gen, "count"), 0) == 0:
            return
        done = [r for r in range(world) if store.get(finished_key(gen, r)) is not None]
    except (RuntimeError, ConnectionError, TimeoutError, OSError):
        return
    for rank in done:
        worker_notes.adopt_finished(rank)


def wait_for_the_others(store: JobStore, world: int, timeout_s: float) -> None:
    """After this rank's code finished in a job of several nodes: wait until every rank
    of its generation (`world` of them) has finished too, or a rank stopped the job (the
    note adopted: see the module), at most `timeout_s`. At once when this rank did not
    say it finished (`share`), or on a single node (its launcher reads every note)."""
    if not _FINISHED or int(os.environ.get("LOCAL_WORLD_SIZE", world)) >= world:
        return
    gen, deadline = _FINISHED[0], time.monotonic() + timeout_s
    try:
        # A peer still in a collective with this rank must fail now, as when this process
        # ended: its groups' connections are cut (a destroyed group may keep them open).
        group_sockets.cut(group_sockets.published(store, f"disttrain/fast/g{gen}", world))
        while time.monotonic() < deadline and not adopt(store):
            if store.add(finished_key(gen, "count"), 0) >= world:
                return
            time.sleep(POLL_S)
    except (RuntimeError, ConnectionError, TimeoutError, OSError):
        return  # the store is gone: the job is over
