"""Whether a slot's supervisor still runs, asked of its node's kernel: a slot supervisor
listens on a socket of its own for its whole life (`listen`), so a connection to it is
refused at once when its process is gone with its node's process tree, and accepted
while it lives (`probe`). A survivor that sees every missing slot's answer needs no
lease (`elastic.membership.Watch`).

- Refused means gone only for an address this process has seen accept before (each
  rank probes its generation's supervisors in the background until each has accepted
  once: `confirm`): no
  process listens any more on the port the supervisor held for its life. A refusal
  never seen otherwise decides nothing, since a firewall between nodes may refuse every
  probe. Accepted means alive (as far as anything listens there), and no answer within
  `PROBE_TIMEOUT_S` means nothing: a machine that lost power or its network answers no
  probe, and the beats' lease decides, as it did before.
- A probe sends and reads nothing: the socket accepts and closes. Its address comes
  from the job's store, sealed with the job's secret (`elastic.job_store`), and at most
  `MAX_ADDRESS` characters of it are read.
- The address is the one this node reaches the job's store from (the etcd, or
  MASTER_ADDR's host): the interface the other nodes see this one on. Beside it goes
  the place its loopback addresses mean (`here`: the kernel's boot id and the network
  namespace): a loopback address (every node reaching an etcd proxy on its own
  `localhost`) is probed only from the same place, never on another host's loopback.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from disttrain.elastic import etcd_store
from disttrain.elastic.job_store import JobStore

KEY = "disttrain/fast/probe/{slot}"
PROBE_TIMEOUT_S = 0.1
"""How long a probe waits for an answer; a machine that is gone gives none, and then the
lease decides."""
MAX_ADDRESS = 300
"""Bound on an address read from the store: HOST:PORT, an IPv6 host included."""
ALIVE, GONE = True, False
CONFIRM_EVERY_S = 1.0
"""How often `confirm` probes again the supervisors that have not accepted yet."""
CONFIRM_FOR_S = 300.0
"""How long `confirm` goes on probing those (a supervisor starts within torchrun's join)."""

_LISTENING: list[socket.socket] = []  # kept for the process's life: its close is the signal
_SEEN_ALIVE: set[tuple[str, int]] = set()
"""The addresses that accepted a probe of this process: only theirs can later be refused."""
_PUBLISHED: dict[int, Published] = {}
"""The slots' addresses read so far: a supervisor publishes one for its life."""
_SAID: dict[int, str] = {}
"""What the last probe of each slot found, in words (`said`)."""


@dataclass(frozen=True)
class Published:
    """Where a slot's supervisor listens, and the place (`here`) its loopback addresses mean."""

    host: str
    port: int
    place: str

    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host.split("%", 1)[0]).is_loopback

    def reachable(self) -> bool:
        """Whether this process can reach the address: not a loopback one of another place."""
        return not self.loopback() or self.place == here()


@functools.cache
def here() -> str:
    """Where this process's loopback addresses lead: the kernel's boot id and this network
    namespace (two containers of one kernel each have their own); the host name where
    /proc has neither."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read(64).strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()[:64]


def _store_host() -> str:
    """The host the job's store is reached at: the etcd endpoint's, else MASTER_ADDR."""
    endpoint = etcd_store.configured()
    if endpoint is not None:
        return endpoint.rpartition(":")[0].strip("[]") or "127.0.0.1"
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def _local_address(towards: str) -> tuple[int, str]:
    """(family, address) of the interface this host routes to `towards` on (no packet is
    sent: a UDP socket's connect only picks the route)."""
    family, _, _, _, where = socket.getaddrinfo(towards, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect(where)
        return family, udp.getsockname()[0]


def node_address() -> tuple[int, str]:
    """(family, address) of this node on the job's network: the interface it reaches the
    job's store from. Raises `OSError` when that host does not resolve."""
    return _local_address(_store_host())


def listen(store: JobStore, slot: int) -> bool:
    """In a slot supervisor: listen on this node's address towards the store, accept and
    close every connection from a daemon thread, and publish the address for `slot`.
    Returns False (nothing published: the lease alone decides) when no address or port
    can be had."""
    try:
        family, host = node_address()
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(64)
    except OSError:
        return False
    _LISTENING.append(sock)
    threading.Thread(target=_answer, args=(sock,), name="disttrain-liveness", daemon=True).start()
    port = sock.getsockname()[1]
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    store.set(KEY.format(slot=slot), f"{where} {here()}")
    return True


def _answer(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def published(store: JobStore, slot: int) -> Published | None:
    """Where `slot`'s supervisor listens (`listen`), read once; None while it has published
    nothing, or when the value is not one `listen` writes."""
    if slot in _PUBLISHED:
        return _PUBLISHED[slot]
    text = store.get(KEY.format(slot=slot))
    if text is None or len(text) > MAX_ADDRESS:
        return None
    where, _, place = text.partition(" ")
    host, _, port = where.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536 or not host or not place:
        return None
    found = Published(host.strip("[]"), int(port), place)
    try:
        found.loopback()
    except ValueError:  # not an IP address
        return None
    _PUBLISHED[slot] = found
    return found


def _address(store: JobStore, slot: int) -> tuple[str, int] | None:
    found = published(store, slot)
    return (found.host, found.port) if found is not None and found.reachable() else None


def confirm(store: JobStore, slots: list[int]) -> None:
    """Probe `slots` from a daemon thread, so that a later refusal of those that accept now
    means that they are gone (`probe`); a slot that has not accepted yet (its supervisor
    not yet listening at a job's start) is probed again every `CONFIRM_EVERY_S`, for up to
    `CONFIRM_FOR_S`. Nothing waits for it; a store error is retried the same way (the
    store's loss ends the generation anyway)."""

    def run() -> None:
        pending, deadline = list(slots), time.monotonic() + CONFIRM_FOR_S
        while pending and time.monotonic() < deadline:
            try:
                answers = probe(store, pending)
            except Exception:  # noqa: BLE001  (any store client's error: a daemon thread must not die of one)
                answers = {}
            pending = [s for s in pending if answers.get(s) is not ALIVE]
            time.sleep(CONFIRM_EVERY_S if pending else 0)

    threading.Thread(target=run, name="disttrain-liveness-confirm", daemon=True).start()


def probe(store: JobStore, slots: list[int], timeout_s: float = PROBE_TIMEOUT_S) -> dict[int, bool | None]:
    """For each of `slots`: `ALIVE` when its supervisor's socket accepts a connection,
    `GONE` when it refuses one and accepted one of this process's probes before, None
    otherwise: no address, a refusal never seen accept, no answer within `timeout_s`
    (the probes run at once, so it is the wait for all)."""
    answers: dict[int, bool | None] = dict.fromkeys(slots)
    pending: dict[socket.socket, tuple[int, tuple[str, int]]] = {}
    for slot in slots:
        where = _address(store, slot)
        if where is None:
            _SAID[slot] = "no address of it is on the store" if slot not in _PUBLISHED else "a loopback of another host"
            continue
        _SAID[slot] = f"no answer from {where[0]}:{where[1]} within {timeout_s:g} s"
        try:
            family = socket.getaddrinfo(where[0], where[1], type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            _SAID[slot] = f"no socket to {where[0]}:{where[1]}: {e.strerror or e}"
            continue
        sock.setblocking(False)
        code = sock.connect_ex(where)
        if code in (0, errno.EINPROGRESS):
            pending[sock] = (slot, where)
        else:
            answers[slot] = _verdict(slot, code, where)
            sock.close()
    with selectors.DefaultSelector() as waiting:  # epoll: a training process may hold over 1024 fds
        for sock in pending:
            waiting.register(sock, selectors.EVENT_WRITE, data=sock)
        deadline = time.monotonic() + timeout_s
        while pending:
            # At least one look after the deadline: a thread of a busy process may wake past
            # it, and the answers that came meanwhile still count.
            left = max(0.0, deadline - time.monotonic())
            for key, _ in waiting.select(left):
                done: socket.socket = key.data
                slot, where = pending.pop(done)
                waiting.unregister(done)
                answers[slot] = _verdict(slot, done.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), where)
                done.close()
            if left == 0:
                break
    for sock in pending:
        sock.close()
    return answers


def _verdict(slot: int, code: int, where: tuple[str, int]) -> bool | None:
    at = f"{where[0]}:{where[1]}"
    if code == 0:
        _SEEN_ALIVE.add(where)
        _SAID[slot] = f"{at} accepted"
        return ALIVE
    if code == errno.ECONNREFUSED and where in _SEEN_ALIVE:
        _SAID[slot] = f"{at} refused"
        return GONE
    seen = "" if code != errno.ECONNREFUSED else ", never seen to accept (a firewall refuses so)"
    _SAID[slot] = f"{at}: {os.strerror(code)}{seen}"
    return None


def said(slot: int) -> str:
    """What this process's last probe of `slot` found, in words (for the console's line
    when the lease, not the probe, decided)."""
    return _SAID.get(slot, "not probed")
