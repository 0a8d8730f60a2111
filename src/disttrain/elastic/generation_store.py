"""Where a generation's process groups rendezvous under the etcd rendezvous: on a TCP
store that the generation's rank 0 hosts for the generation's life, not on the etcd.

Every process group of a generation (the default one, the buddy copy's, the
checkpointer's) is made on the default group's store, and each costs a few store round
trips per rank: on the etcd each is an HTTP request and each wait a poll, a fifth of a
second and more per group on a loaded host, paid again in every recovery and every
admission. A generation's groups need their store only while the generation lives, and
no longer than its rank 0 does (its loss ends the generation anyway), so rank 0 hosts
one (`runtime.store_server.hosted_store`: it listens on this node's address on the
job's network only) and publishes where, sealed with the job's secret, on the job's
store (`elastic.job_store`); the others read that and connect.

The address is the one this node reaches the etcd from (`elastic.liveness.node_address`).
When that is a loopback address and a member is in another place (another host or
network namespace: an etcd proxy on each node's `localhost`, an etcd named `localhost`
on rank 0's host only), the other nodes could not reach it: the generation then
rendezvouses on the etcd, as before. Without the etcd (the TCP store of
global rank 0's supervisor) the job's store is used as it is.
"""

from __future__ import annotations

import datetime
import ipaddress
import time

import torch.distributed as dist

from disttrain.elastic import etcd_store, liveness
from disttrain.elastic.job_store import JobStore
from disttrain.runtime.store_server import hosted_store

KEY = "disttrain/fast/g{gen}/groups_store"
ON_ETCD = "etcd"
"""The published value when the generation rendezvouses on the etcd itself."""
POLL_S = 0.002

_HOSTED: list[dist.Store] = []  # the generation's server, kept until the next generation's


def for_generation(store: JobStore, gen: int, rank: int, slots: list[int], timeout_s: float) -> dist.Store:
    """The store generation `gen`'s groups rendezvous on, for the process of rank `rank`
    (its slot list `slots`, in rank order): rank 0 hosts it, the others connect to it.
    Raises `TimeoutError` when rank 0 publishes nothing within `timeout_s`."""
    if etcd_store.configured() is None:
        return store.store
    _HOSTED.clear()  # the last generation's groups are destroyed: its server may go
    key = KEY.format(gen=gen)
    if rank == 0:
        store.set(key, _host(store, slots, timeout_s))
        return _HOSTED[0] if _HOSTED else store.store
    deadline = time.monotonic() + timeout_s
    while (published := store.get(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {gen}: rank 0 did not say where its groups meet within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return _connect(store, published, timeout_s)


def _host(store: JobStore, slots: list[int], timeout_s: float) -> str:
    """Start the generation's server on this node's address; 'HOST:PORT', or `ON_ETCD`
    when the other nodes could not reach it (see the module)."""
    try:
        family, host = liveness.node_address()
        if _is_loopback(host) and not _all_here(store, slots):
            return ON_ETCD
        server = hosted_store(
            host, 0, one_node=True, what="a generation's store", timeout_s=timeout_s, wait_for_workers=False
        )
    except OSError:
        return ON_ETCD
    _HOSTED.append(server)
    return f"[{host}]:{server.port}" if ":" in host else f"{host}:{server.port}"


def _connect(store: JobStore, where: str, timeout_s: float) -> dist.Store:
    if where == ON_ETCD:
        return store.store
    host, _, port = where.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536 or not host or len(where) > liveness.MAX_ADDRESS:
        raise ValueError(f"rank 0 published no address for its generation's store: {where[:100]!r}")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback


def _all_here(store: JobStore, slots: list[int]) -> bool:
    """Whether every slot's supervisor is in this process's place (`liveness.here`: the
    same kernel and network namespace), where this loopback address leads to rank 0."""
    for slot in slots:
        found = liveness.published(store, slot)
        if found is None or found.place != liveness.here():
            return False
    return True
