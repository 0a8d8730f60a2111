"""The note that stopped one node, shown by every node of a job on torchrun's restart path.

A rank's note (the program's error, a user error, a crash loop: `worker_notes`) is read
by its own node's launcher only; another node learns that the job stopped from its
closed rendezvous (`launch.rendezvous_end`) and can only point to the node that stopped.
When the job has a secret (`DISTTRAIN_JOB_SECRET`, exported the same on every node: a
multi-node job's launchers cannot share one they made), the stopping node's launcher
also puts the note, sealed with it (`elastic.job_store`), on the rendezvous' own store,
before its agent stops a worker (`publish`, from the notes watcher). A launcher whose
ranks lost their peer to that stop copies it into its own notes (`adopt`), and prints
the same traceback, line and exit status as the node that stopped.

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
import os
from pathlib import Path
from typing import Any

from disttrain.errors import UserError
from disttrain.launch.rendezvous_end import Seen
from disttrain.runtime import job_secret
from disttrain.runtime.log import LOGGER

CONNECT_S = 3.0
C10D_PORT = 29400
"""torchrun's port of a c10d endpoint given without one."""


def _secret() -> bytes | None:
    """The job's secret, or None without a usable one (nothing is relayed then)."""
    if not os.environ.get(job_secret.SECRET_ENV):
        return None
    try:
        return job_secret.from_env()
    except UserError:
        return None


def _store(seen: Seen, secret: bytes) -> Any | None:
    """A sealed client of the rendezvous' store in this run's and round's directory; None
    when there is none to reach (static rendezvous, no endpoint, no round yet)."""
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


def publish(seen: Seen, note: tuple[str, str] | None) -> None:
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


def adopt(seen: Seen, folder: str) -> bool:
    """Whether another node's sealed note is on the rendezvous' store; it is then copied
    into this launch's notes `folder` (`job_stop.adopt`), for this launcher's report."""
    secret = _secret()
    if secret is None:
        return False
    from disttrain.elastic import job_stop

    try:
        store = _store(seen, secret)
    except Exception as e:  # a store that cannot be reached holds no note for us
        LOGGER.debug(f"disttrain run: the stop note could not be read: {type(e).__name__}: {e}")
        return False
    return store is not None and job_stop.adopt(store, Path(folder))
