"""The TCP connections of a generation's gloo groups, told apart from every other
connection of the process (a user's tracker, a data service), so that an in-memory
recovery cuts only the former.

A gloo group's connection always has a group listener at one end: each rank's gloo
device listens on a port of its own, and of each pair of ranks one connects to the
other's listener (checked on torch 2.13, one device per group). So each
rank publishes, on the generation's store, the listening endpoints it opened since
the generation began (`publish`: right after each group is made: the generation's,
the buddy copy's, the checkpointer's), and a survivor cuts the
connections whose local or remote endpoint is one of them (`cut`). A connection's
endpoints are asked of the socket itself (each socket this process holds, found in
/proc/self/fd: Linux; elsewhere nothing is cut and a blocked survivor waits for the
group's timeout). The lists are sealed with
the job's secret (`elastic.job_store`): one that a client outside the job wrote, or that
does not parse, is skipped, so it can neither crash a survivor nor choose what it cuts.
"""

from __future__ import annotations

import os
import socket

from disttrain.elastic.job_store import JobStore
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker


def _socket_fds() -> list[int]:
    """This process's open sockets' descriptors (empty where /proc is absent)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:["):
                found.append(int(name))
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
    return found


def _host(address: tuple) -> tuple[str, int]:
    """(host, port) of a socket address, an IPv6 scope dropped: two nodes name the same
    link by interfaces of their own."""
    return str(address[0]).split("%", 1)[0], int(address[1])


def tcp_sockets() -> list[tuple[int, bool, tuple[str, int], tuple[str, int]]]:
    """This process's TCP sockets: (fd, listening, local, remote; ("", 0) when not
    connected). Each socket is asked through a duplicate of its descriptor (closing the
    duplicate leaves the socket as it was), not found in /proc/net/tcp, whose read
    walks the whole namespace's tables (tens of ms on a busy host, on the recovery's
    path)."""
    rows = []
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
                local = _host(sock.getsockname())
            except OSError:
                continue
            try:
                remote = _host(sock.getpeername())
            except OSError:  # not connected
                remote = ("", 0)
            rows.append((fd, listening, local, remote))
    return rows


def listeners() -> set[tuple[str, int]]:
    return {local for _, listening, local, _ in tcp_sockets() if listening}


def publish(store: JobStore, prefix: str, rank: int, before: set[tuple[str, int]]) -> None:
    """Put this rank's listeners opened since `before` (the generation's start) on the
    store under `prefix`, sealed."""
    mine = sorted(listeners() - before)
    store.set(f"{prefix}/listen/{rank}", ",".join(f"{host}|{port}" for host, port in mine))


def _parsed(text: str) -> set[tuple[str, int]] | None:
    """A published list, or None when it is not one `publish` writes."""
    found = set()
    for item in filter(None, text.split(",")):
        host, _, port = item.rpartition("|")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return None
        found.add((host, int(port)))
    return found


def published(store: JobStore, prefix: str, world: int) -> set[tuple[str, int]]:
    """Every rank's published listeners (a rank that published nothing, or whose value
    is not the job's or does not parse: none)."""
    found: set[tuple[str, int]] = set()
    for rank in range(world):
        key = f"{prefix}/listen/{rank}"
        text = store.get(key)
        listed = _parsed(text) if text is not None else set()
        if listed is None:
            LOGGER.warning(f"{speaker()}: ignored {key}: not a list of host:port addresses", extra=EVERY_RANK)
            continue
        found |= listed
    return found


def _matches(endpoint: tuple[str, int], group_listeners: set[tuple[str, int]]) -> bool:
    """`endpoint` is one of the listeners (one bound to every address: by its port)."""
    return any(port == endpoint[1] and host in (endpoint[0], "0.0.0.0", "::") for host, port in group_listeners)


def cut(group_listeners: set[tuple[str, int]]) -> int:
    """Shut down every connection of this process with a group listener at one end;
    returns how many. A shut connection fails a collective's wait at once."""
    shut = 0
    for fd, listening, local, remote in tcp_sockets():
        if listening or not (_matches(local, group_listeners) or _matches(remote, group_listeners)):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:  # closed meanwhile
            continue
    return shut
