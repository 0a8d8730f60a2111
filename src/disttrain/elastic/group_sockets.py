"""The TCP connections of a generation's gloo groups, told apart from every other
connection of the process (a user's tracker, a data service), so that an in-memory
recovery cuts only the former.

A gloo group's connection always has a group listener at one end: each rank's gloo
device listens on a port of its own, and of each pair of ranks one connects to the
other's listener (checked on torch 2.13, one device per group). So each
rank publishes, on the generation's store, the listening endpoints it opened since
the generation began (`publish`: right after each group is made: the generation's,
the buddy copy's, the checkpointer's), and a survivor cuts the
connections whose local or remote endpoint is one of them (`cut`). What a
connection's endpoints are comes from /proc/self/net/tcp[6] (Linux; elsewhere nothing
is cut and a blocked survivor waits for the group's timeout). The lists are sealed with
the job's secret (`elastic.job_store`): one that a client outside the job wrote, or that
does not parse, is skipped, so it can neither crash a survivor nor choose what it cuts.
"""

from __future__ import annotations

import os
import socket
import sys

from disttrain.elastic.job_store import JobStore
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker

LISTEN = "0A"  # the kernel's TCP_LISTEN state in /proc/net/tcp


def _inodes() -> dict[str, int]:
    """This process's open sockets: inode -> fd (empty where /proc is absent)."""
    found: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[link[8:-1]] = int(name)
    return found


def _endpoint(hex_addr: str) -> tuple[str, int]:
    """'0100007F:9261' -> ('127.0.0.1', 37473); IPv6 too (the kernel's byte order)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def tcp_sockets() -> list[tuple[int, str, tuple[str, int], tuple[str, int]]]:
    """This process's TCP sockets: (fd, state, local, remote)."""
    mine, rows = _inodes(), []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[9] in mine:
                rows.append((mine[parts[9]], parts[3], _endpoint(parts[1]), _endpoint(parts[2])))
    return rows


def listeners() -> set[tuple[str, int]]:
    return {local for _, state, local, _ in tcp_sockets() if state == LISTEN}


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
    for fd, state, local, remote in tcp_sockets():
        if state == LISTEN or not (_matches(local, group_listeners) or _matches(remote, group_listeners)):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:  # closed meanwhile
            continue
    return shut
