"""Fast recovery's notes that stop the job (`elastic.job_stop`), shared from the
processes around a training process that hold no client of the job's store: the slot
supervisor and a worker's stub, which report a crash or a crash loop they saw
(`runtime.failures.report_crash`, `repeated_death`). They connect when a note comes,
so torch is imported then, not at their start; the note waits for it, so it is on the
store before this node's launcher acts on it."""

from __future__ import annotations

import os

from disttrain import worker_notes

ROLE_ENV = "DISTTRAIN_FAST_ROLE"  # elastic.fast_recovery.ROLE_ENV; not imported: that imports torch
FAST_STORE_ENV = "DISTTRAIN_FAST_STORE"  # elastic.etcd_store.STORE_ENV: the store is that etcd
CONNECT_S = 10.0


def _send(kind: str, text: str) -> None:
    from disttrain.elastic import job_stop, job_store

    if kind != worker_notes.FINISHED:  # a finish is the training process's to share
        job_stop.publish(job_store.connect(timeout_s=CONNECT_S), kind, text)


def _other_nodes() -> bool:
    """Whether the job may have ranks on other nodes: more slots than this node's, or a
    store on etcd (a node may join it later). On one node its launcher reads every note,
    and a crash's note need not wait for torch's import."""
    local, total = os.environ.get("LOCAL_WORLD_SIZE", "1"), os.environ.get("WORLD_SIZE", "1")
    return bool(os.environ.get(FAST_STORE_ENV)) or (local.isdigit() and total.isdigit() and int(local) < int(total))


def share() -> None:
    """This process's notes that stop the job go to the job's store too, when the job
    may have other nodes (a slot supervisor's; see the module)."""
    if _other_nodes():
        worker_notes.share_stops(_send)


def share_if_fast() -> None:
    """`share`, in a process of a fast-recovery slot (its stub: `ROLE_ENV` is set)."""
    if os.environ.get(ROLE_ENV):
        share()
