"""The note that stopped one node, shown by every node of a job on torchrun's restart path.

A rank's note (the program's error, a user error, a crash loop: `worker_notes`) is read
by its own node's launcher only; another node learns that the job stopped from its
closed rendezvous (`launch.rendezvous_end`) and can only point to the node that stopped.
When the job has a secret (`DISTTRAIN_JOB_SECRET`, exported the same on every node: a
multi-node job's launchers cannot share one they made), the stopping node's launcher
also puts the note, sealed with it (`elastic.job_store`), on the rendezvous' own store,
before its agent stops a worker (`publish`, from the notes watcher). A launcher whose
ranks lost their peer to that stop copies it into its own notes (`adopt`), and prints
the same traceback, line and exit status as the node that stopped. Its ranks whose
collective failed read it first (`adopt_in_worker`: the launcher hands them where the
rendezvous is in `RELAY_ENV`, their round is their MASTER_ADDR and MASTER_PORT) and
exit quietly, instead of saying that they lost a peer and that torchrun restarts them.
A rank whose code finished while its peers train (a `return` on one rank) puts its
finish there too (`share_from_worker`), so that a rank of another node names the early
finish instead of a lost peer; and every launcher asks for a relayed note twice a
second (`launch.notes_watch`), so that a node whose agent waits at torchrun's exit
barrier or in a rendezvous stops as well.

The store is the rendezvous' own: the etcd under `--rdzv-backend etcd` (no node hosts
it), the c10d store at the endpoint under c10d (hosted by one node's agent: gone with
it, and the others then keep the line that points to it). The key is named by the run
id and the round's store address, both fresh for each job. Whatever is on that store
came from anyone who can reach it: a note is adopted only when its seal holds, it is at
most `job_stop.MAX_NOTE_CHARS`, and it is a note that stops the job
(`worker_notes.adopt_stop`). Without a secret nothing is written or read.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain import worker_notes
from disttrain.errors import UserError
from disttrain.runtime import job_secret
from disttrain.runtime.log import LOGGER

CONNECT_S = 3.0
C10D_PORT = 29400
"""torchrun's port of a c10d endpoint given without one."""
RELAY_ENV = "DISTTRAIN_STOP_RELAY"
"""Set by `disttrain run` for its workers in a job of several nodes: the rendezvous'
backend, endpoint and run id, as a JSON list (used only with the job's secret)."""


@dataclass(frozen=True)
class Where:
    """A rendezvous round: torchrun's backend name, its endpoint, the run id, and the
    round's store address (`RendezvousInfo.bootstrap_store_info`, `HOST_PORT`)."""

    backend: str | None
    endpoint: str | None
    run_id: str
    round: str | None


def for_workers(where: Where) -> str:
    """`RELAY_ENV`'s value for the workers of the rendezvous `where`."""
    return json.dumps([where.backend, where.endpoint, where.run_id])


def _worker_round() -> Where | None:
    """The round this worker is in, from `RELAY_ENV` and its MASTER_ADDR and MASTER_PORT."""
    try:
        backend, endpoint, run_id = json.loads(os.environ.get(RELAY_ENV, ""))
    except (ValueError, TypeError):  # unset, or not the launcher's list: no relay
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port) or not all(isinstance(v, str) for v in (backend, endpoint, run_id)):
        return None
    return Where(backend, endpoint, run_id, f"{addr}_{port}")


def _secret() -> bytes | None:
    """The job's secret, or None without a usable one (nothing is relayed then)."""
    if not os.environ.get(job_secret.SECRET_ENV):
        return None
    try:
        return job_secret.from_env()
    except UserError:
        return None


@functools.lru_cache(maxsize=4)
def _store(seen: Where, secret: bytes) -> Any | None:
    """A sealed client of the rendezvous' store in this run's and round's directory; None
    when there is none to reach (static rendezvous, no endpoint, no round yet). One per
    round: a launcher asks it twice a second (`launch.notes_watch`)."""
    from disttrain.elastic.job_store import JobStore

    if seen.endpoint is None or seen.round is None:
        return None
    prefix = f"disttrain/stopped/{seen.run_id}/{seen.round}"
    if seen.backend == "etcd-v2":
        from disttrain.elastic import etcd_store

        return JobStore(etcd_store.connect(seen.endpoint, CONNECT_S, prefix=prefix), secret)
    if seen.backend != "c10d":
        return None
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(seen.endpoint, default_port=C10D_PORT)
    timeout = datetime.timedelta(seconds=CONNECT_S)
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return JobStore(dist.PrefixStore(prefix + "/", client), secret)


def publish(seen: Where, note: tuple[str, str] | None) -> None:
    """Put this node's `note` (kind, text: `worker_notes.read_stop`) on the rendezvous'
    store for the other nodes (see the module). A store that cannot be reached is
    logged and left: the others then say that another node stopped the job."""
    secret = _secret()
    if note is None or secret is None:
        return
    from disttrain.elastic import job_stop

    try:
        store = _store(seen, secret)
        if store is not None:
            job_stop.publish(store, *note)
    except Exception as e:  # any backend's error: this node stops either way
        LOGGER.debug(f"disttrain run: the stop note was not relayed: {type(e).__name__}: {e}")


def adopt(seen: Where, folder: str | None = None) -> bool:
    """Whether another node's sealed note is on the rendezvous' store; it is then copied
    into this launch's notes (the launcher's `folder`, or a worker's: `job_stop.adopt`),
    for this node's launcher's report."""
    secret = _secret()
    if secret is None:
        return False
    from disttrain.elastic import job_stop

    try:
        store = _store(seen, secret)
        return store is not None and job_stop.adopt(store, Path(folder) if folder else None)
    except Exception as e:  # a store that cannot be reached (any backend's error) holds no note for us
        LOGGER.debug(f"disttrain run: the stop note could not be read: {type(e).__name__}: {e}")
        return False


def adopt_in_worker() -> bool:
    """In a worker whose collective failed: whether a rank of another node stopped the
    job with a note relayed on the rendezvous' store (then copied into this node's
    notes). The ranks of other nodes whose code finished are copied too
    (`job_stop.adopt_finished`), for `failures.report_early_finish`. False outside a job
    that relays (one node, no secret)."""
    where, secret = _worker_round(), _secret()
    if where is None or secret is None or not worker_notes.under_launcher():
        return False
    if adopt(where):
        return True
    from disttrain.elastic import job_stop

    try:
        store = _store(where, secret)
        if store is not None:
            job_stop.adopt_finished(store, 0, int(os.environ.get("WORLD_SIZE", "1")))
    except Exception:  # unreachable (any backend's error): no finish to copy either
        pass
    return False


def share_from_worker() -> None:
    """In a worker of a job that relays: its notes that stop the job and its rank's finish
    (a `return` while its peers train) go onto its round's store too, before its node's
    folder (`worker_notes.share_stops`; the store is reached at the first note)."""
    if _worker_round() is not None and _secret() is not None:
        worker_notes.share_stops(_send_from_worker)


def _send_from_worker(kind: str, text: str) -> None:
    from disttrain.elastic import job_stop

    where, secret = _worker_round(), _secret()
    store = _store(where, secret) if where is not None and secret is not None else None
    if store is not None:
        job_stop.send(store, lambda: 0, kind, text)
