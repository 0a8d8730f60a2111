"""Fast recovery's store, as the job's processes use it: values sealed with the job's
secret, and a server that listens only where the job does.

- `JobStore` wraps a torch store: `set` seals each value (`runtime.job_secret`: an
  HMAC-SHA256 over key and value, keyed by the secret `disttrain run` handed the
  ranks), and `get` returns None for a value whose tag fails, with one log line per
  key. A client outside the job can still connect, read, overwrite or delete keys (a
  `TCPStore` has no authentication); what it cannot do is make a rank act on a value
  it wrote. The counters (`add`) and torch's own keys (the process groups' rendezvous)
  are not sealed.
- `listening_socket` binds the server's socket to the address MASTER_ADDR resolves to
  (torch's own `TCPStore` server listens on every interface); `host_store` hands that
  socket to the store.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

from disttrain.runtime import job_secret
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker


class JobStore:
    """A store whose values disttrain seals and checks (see the module)."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        self.store = store
        self._secret = secret
        self._refused: set[str] = set()

    def set(self, key: str, value: str) -> None:
        # torch types the value as str; bytes are stored exactly as given
        self.store.set(key, job_secret.seal(self._secret, key, value.encode()))  # type: ignore[arg-type]

    def get(self, key: str) -> str | None:
        """The value of `key`; None when it is absent, or when it does not carry the
        job's seal (said once per key: a client outside the job wrote it)."""
        if not self.store.check([key]):
            return None
        value = job_secret.open_sealed(self._secret, key, self.store.get(key))
        if value is not None:
            try:
                return value.decode()
            except UnicodeDecodeError:  # sealed by the job, so never; kept as absent all the same
                return None
        if key not in self._refused:
            self._refused.add(key)
            LOGGER.warning(
                f"{speaker()}: ignored the value of {key} on fast recovery's store: it does not carry "
                f"the job's secret (a client outside the job wrote it)",
                extra=EVERY_RANK,
            )
        return None

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)


def connect(timeout_s: float) -> JobStore:
    """A client of the slot supervisor's store (it may still be starting: the client
    retries), with the job's secret (`UserError` when the rank has none)."""
    secret = job_secret.from_env()
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return JobStore(store, secret)


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback


def bind_address(host: str, port: int, one_node: bool) -> tuple[socket.AddressFamily, str] | None:
    """Where the store listens: the address `host` (MASTER_ADDR) resolves to here, IPv4
    first. None (every interface, as torch would) only when that address is a loopback
    one in a job of several nodes (a host name that /etc/hosts maps to 127.0.1.1, while
    the other nodes reach it by its network address)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found.sort(key=lambda info: info[0] != socket.AF_INET)
    family, address = found[0][0], str(found[0][4][0])
    if _is_loopback(address) and not one_node:
        return None
    return family, address


def listening_socket(host: str, port: int, one_node: bool) -> socket.socket:
    """A listening TCP socket on `port` at `bind_address`; says so once when it has to
    listen on every interface."""
    where = bind_address(host, port, one_node)
    if where is None:
        LOGGER.warning(
            f"disttrain: MASTER_ADDR {host} is a loopback address on this node of a multi-node job; "
            f"fast recovery's store listens on every interface (set MASTER_ADDR to this node's "
            f"address on the job's network to bind it there)"
        )
        where = (socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET, "::" if socket.has_ipv6 else "0.0.0.0")
    sock = socket.socket(where[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted attempt reuses the port
    sock.bind((where[1], port))
    sock.listen(512)
    return sock


def host_store(timeout_s: float) -> dist.TCPStore:
    """The store server of global rank 0's slot supervisor, at MASTER_ADDR:MASTER_PORT,
    listening only on MASTER_ADDR's address (`listening_socket`)."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    one_node = os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
    sock = listening_socket(host, port, one_node)
    return dist.TCPStore(
        host,
        port,
        world_size=None,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the descriptor from now on
    )
