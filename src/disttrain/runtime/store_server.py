"""A `TCPStore` server that listens only where the job does.

torch's own `TCPStore` server listens on every interface of its node, so any host on
the cluster network can reach it (docs/security.md). `hosted_store` binds the server's
socket to the address the job's host name (MASTER_ADDR, a rendezvous endpoint)
resolves to on this node and hands that socket to the store (`master_listen_fd`).
Fast recovery's store (`elastic.job_store`) and `disttrain check`'s stores are made so.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import Any

import torch.distributed as dist

from disttrain.runtime.log import LOGGER


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback


def bind_address(host: str, port: int, one_node: bool) -> tuple[socket.AddressFamily, str] | None:
    """Where a server for the job listens: the address `host` resolves to here, IPv4
    first. None (every interface, as torch would) only when that address is a loopback
    one in a job of several nodes (a host name that /etc/hosts maps to 127.0.1.1, while
    the other nodes reach it by its network address). Raises `OSError` (socket.gaierror)
    for a name that does not resolve."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found.sort(key=lambda info: info[0] != socket.AF_INET)
    family, address = found[0][0], str(found[0][4][0])
    if _is_loopback(address) and not one_node:
        return None
    return family, address


def listening_socket(host: str, port: int, one_node: bool, what: str) -> socket.socket:
    """A listening TCP socket on `port` at `bind_address`; says once, naming the server
    `what`, when it has to listen on every interface. `port` 0 takes a free one."""
    where = bind_address(host, port, one_node)
    if where is None:
        LOGGER.warning(
            f"disttrain: {host} is a loopback address on this node of a multi-node job; "
            f"{what} listens on every interface (give this node's address on the job's "
            f"network instead to bind it there)"
        )
        where = (socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET, "::" if socket.has_ipv6 else "0.0.0.0")
    sock = socket.socket(where[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted attempt reuses the port
    sock.bind((where[1], port))
    sock.listen(512)
    return sock


def hosted_store(host: str, port: int, *, one_node: bool, what: str, timeout_s: float, **options: Any) -> dist.TCPStore:
    """The server of a `TCPStore` at `host:port`, listening only on `host`'s address
    (`listening_socket`); `options` go to `TCPStore` (world_size, wait_for_workers).
    Raises `OSError` when the address cannot be bound (in use, not this node's)."""
    sock = listening_socket(host, port, one_node, what)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the descriptor from now on
        **options,
    )
