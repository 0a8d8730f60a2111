"""A local etcd server for elastic rendezvous: `disttrain etcd start`.

torch's etcd rendezvous backends (`etcd-v2`, and the legacy `etcd`) speak etcd's v2
API, which etcd 3.4 serves only with `--enable-v2=true`; without it both fail (404 or
a connection error). The server binds 127.0.0.1 by default, keeps its data in a
directory of its own, and is stopped (SIGTERM, then SIGKILL) by `stop()`. It gets
SIGTERM from the kernel when the process that started it dies (PR_SET_PDEATHSIG), and
`disttrain etcd start` stops it on its own SIGTERM, SIGHUP or Ctrl-C: it never outlives
the command. With a `prefix` such as `ip netns exec NS` it runs (and is health-checked)
inside another network namespace, bound to that namespace's address.

This server has no authentication and no TLS: any process that can reach its address
can read and change the rendezvous. Hence loopback by default; `--host ADDR` is for a
network only the job's nodes reach. For anything wider, run etcd yourself with its
client TLS and authentication (docs/security.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from disttrain.errors import UserError
from disttrain.runtime import processes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    """Path of the etcd binary. Raises `UserError` with the install command if missing."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise UserError(
            "etcd is not installed. On Debian/Ubuntu: apt-get install -y etcd-server; "
            "Python side: pip install python-etcd."
        )
    return path


def _die_with_parent() -> None:
    # in the child before exec: etcd gets SIGTERM when the thread that started it dies
    processes.die_with_parent(signal.SIGTERM)


class _Stopped(Exception):
    """A signal that ends `disttrain etcd start`."""


def _stop_on_signal(signum, _frame) -> None:
    raise _Stopped(signum)


@dataclass
class EtcdServer:
    """One etcd process. `endpoint` is host:port for `--rdzv-endpoint`.

    `prefix`: a command to run etcd under, e.g. ("ip", "netns", "exec", "NS"). Ports
    cannot be probed from this namespace then, so pass `port` (the peer port is port + 1).
    """

    host: str = "127.0.0.1"
    port: int = 0
    data_dir: Path | None = None
    prefix: tuple[str, ...] = ()
    process: subprocess.Popen | None = field(default=None, repr=False)
    _own_dir: bool = field(default=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0, log_path: str | os.PathLike | None = None) -> EtcdServer:
        """Start etcd and wait until it answers /health. Raises `UserError` on failure."""
        if self.prefix and not self.port:
            raise UserError("EtcdServer with a prefix needs an explicit port.")
        self.port = self.port or free_port(self.host)
        peer_port = self.port + 1 if self.prefix else free_port(self.host)
        if self.data_dir is None:
            self.data_dir, self._own_dir = Path(tempfile.mkdtemp(prefix="disttrain-etcd-")), True
        url = f"http://{self.host}:{self.port}"
        cmd = [
            find_etcd(),
            "--enable-v2=true",
            "--name",
            "disttrain",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://{self.host}:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://{self.host}:{peer_port}",
            "--initial-cluster",
            f"disttrain=http://{self.host}:{peer_port}",
        ]
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [*self.prefix, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the command, which stops etcd
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(
                    f"etcd exited with status {self.process.returncode} at start; "
                    f"is port {self.port} taken? Run it by hand to see its log: {' '.join(cmd)}"
                )
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise UserError(f"etcd did not become healthy on {url} within {timeout_s:.0f} s.")

    def healthy(self) -> bool:
        if self.prefix:  # the address is only reachable from inside the prefix's namespace
            check = (
                "import json,sys,urllib.request as u; r = u.urlopen(sys.argv[1], timeout=1); "
                "sys.exit(json.loads(r.read()).get('health') != 'true')"
            )
            try:
                return (
                    subprocess.run(
                        [*self.prefix, sys.executable, "-c", check, f"http://{self.endpoint}/health"],
                        capture_output=True,
                        timeout=5,
                    ).returncode
                    == 0
                )
            except subprocess.TimeoutExpired:
                return False
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, remove_data: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s); remove its own data dir."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if remove_data and self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> EtcdServer:
        """Stop and start again on the same port and data dir (state is kept)."""
        self.stop(remove_data=False)
        return self.start()

    def __enter__(self) -> EtcdServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """`disttrain etcd start [--host ADDR] [--port N] [--data-dir DIR]`: run in the
    foreground until Ctrl-C, SIGTERM or SIGHUP, each of which stops etcd too."""
    import argparse

    parser = argparse.ArgumentParser(prog="disttrain etcd")
    parser.add_argument("action", choices=["start"])
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1); etcd here has no authentication or TLS: "
        "bind it only to a network that the job's nodes alone reach (docs/security.md)",
    )
    parser.add_argument("--port", type=int, default=2379)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    server = EtcdServer(host=args.host, port=args.port, data_dir=args.data_dir)
    try:
        server.start()
        print(
            f"etcd (v2 API on, no authentication) serving on {server.endpoint}. Use it with:\n"
            f"  disttrain run --nnodes 1:2 --rdzv-backend etcd --rdzv-endpoint {server.endpoint} "
            f"--rdzv-id JOB script.py\nCtrl-C stops it.",
            flush=True,
        )
        assert server.process is not None  # start() started it
        server.process.wait()
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        server.stop(remove_data=args.data_dir is None)
    return 0
