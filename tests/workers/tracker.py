"""A stand-in for a user's tracker client (tests/workers/failing_job.py): one TCP
connection per process, opened on first use and kept in this module, so it outlives a
script that runs again in the next generation of an in-memory recovery."""

import socket

_conn: socket.socket | None = None


def send(port: int, line: str) -> None:
    global _conn
    if _conn is None:
        _conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    _conn.sendall(f"{line}\n".encode())
