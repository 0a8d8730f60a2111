"""The facts `disttrain check` gathers on one node, and the rules that compare nodes.

Everything here is local to one process: no collective, no store. `node_facts` reads
versions, the visible device count and the checkpoint directory; `reach` opens one TCP
connection to the rendezvous endpoint; `problems` turns every node's facts (the same
list on every node, after the exchange) into one line per problem, each naming a node.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

GIB = 1024**3


@dataclass
class NodeFacts:
    """What one node reports. `addr` is the address other nodes reach it at (the local
    end of its connection to the rendezvous endpoint); `host` its hostname."""

    host: str
    addr: str
    python: str
    torch: str
    disttrain: str
    devices: int
    nproc: int
    ckpt_dir: str = ""
    ckpt_free_gib: float | None = None
    ckpt_error: str = ""
    clock_offset_s: float | None = None
    rank: int = 0

    @property
    def name(self) -> str:
        return f"{self.addr} ({self.host})" if self.addr != self.host else self.host

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> NodeFacts:
        """Fields another disttrain version added are dropped, so its version can be named."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def visible_devices() -> int:
    """CUDA devices this node sees (0 without CUDA); honours CUDA_VISIBLE_DEVICES."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_facts(addr: str, nproc: int, ckpt_dir: str) -> NodeFacts:
    """This node's versions, device count and checkpoint directory (see `probe_dir`)."""
    import torch

    import disttrain.version

    facts = NodeFacts(
        host=socket.gethostname(),
        addr=addr,
        python=platform.python_version(),
        torch=torch.__version__,
        disttrain=disttrain.version.__version__,
        devices=visible_devices(),
        nproc=nproc,
        ckpt_dir=ckpt_dir,
    )
    if ckpt_dir:
        facts.ckpt_free_gib, facts.ckpt_error = probe_dir(Path(ckpt_dir))
    return facts


def probe_dir(path: Path) -> tuple[float | None, str]:
    """(free GiB, error) at `path`: it is created if missing (the trainer would create
    it too), a probe file is written, fsynced and removed. The error is '' when writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".disttrain-check-", dir=path)
        try:
            os.write(fd, b"x")
            os.fsync(fd)  # a full or read-only disk often fails only here
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        free = _free_gib(path)
        return free, f"not writable ({e.strerror or e})"
    return _free_gib(path), ""


def _free_gib(path: Path) -> float | None:
    for p in (path, *path.parents):  # the nearest directory that exists
        try:
            return shutil.disk_usage(p).free / GIB
        except OSError:
            continue
    return None


def reach(host: str, port: int, deadline: float) -> str:
    """Connect to host:port until `deadline` (time.monotonic); return this node's
    address on that connection. Raises `OSError` (the last one seen) at the deadline:
    a store that is not up yet is retried, a cut link or a firewall stays an error."""
    last: OSError = TimeoutError("no attempt made")
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise last
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)) as s:
                return s.getsockname()[0]
        except OSError as e:
            last = e
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def is_local_address(host: str) -> bool:
    """Whether `host` names an address of this machine (or network namespace): binding
    to it succeeds only then. Decides which node hosts the c10d rendezvous store."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class Limits:
    """The thresholds a healthy job stays within."""

    min_free_gib: float = 1.0
    max_clock_skew_s: float = 2.0


def _odd_ones(nodes: list[NodeFacts], key: str) -> list[tuple[NodeFacts, object, NodeFacts]]:
    """Nodes whose `key` differs from the most common value (rank 0's on a tie), each
    with the value and a node that has the common one."""
    values = [getattr(n, key) for n in nodes]
    counts = Counter(values).most_common()
    common = values[0] if len(counts) > 1 and counts[0][1] == counts[1][1] else counts[0][0]
    ref = next(n for n in nodes if getattr(n, key) == common)
    return [(n, getattr(n, key), ref) for n in nodes if getattr(n, key) != common]


def problems(nodes: list[NodeFacts], limits: Limits) -> list[str]:
    """One line per problem, each naming the node and what to do. Empty when healthy."""
    out = []
    for key, label in (("disttrain", "disttrain"), ("torch", "torch"), ("python", "Python")):
        for n, value, ref in _odd_ones(nodes, key):
            out.append(
                f"node {n.name}: {label} {value} differs from {getattr(ref, key)} on node "
                f"{ref.name}; install the same {label} version on every node."
            )
    for n, value, ref in _odd_ones(nodes, "devices"):
        out.append(
            f"node {n.name}: sees {value} GPU(s), node {ref.name} sees {ref.devices}; "
            f"check CUDA_VISIBLE_DEVICES and the node's drivers."
        )
    for n in nodes:
        if n.devices and n.nproc > n.devices:
            out.append(
                f"node {n.name}: --nproc-per-node {n.nproc} is more than its {n.devices} "
                f"visible GPU(s); each process needs its own GPU."
            )
        if n.ckpt_error:
            out.append(
                f"node {n.name}: checkpoint directory {n.ckpt_dir} is {n.ckpt_error}; "
                f"point checkpoint.dir at a writable (shared) directory."
            )
        elif n.ckpt_free_gib is not None and n.ckpt_free_gib < limits.min_free_gib:
            out.append(
                f"node {n.name}: only {n.ckpt_free_gib:.2f} GiB free at {n.ckpt_dir} "
                f"(at least {limits.min_free_gib:g} GiB asked by --min-free-gib); free "
                f"space or move checkpoint.dir."
            )
        if n.clock_offset_s is not None and abs(n.clock_offset_s) > limits.max_clock_skew_s:
            out.append(
                f"node {n.name}: its clock is {n.clock_offset_s:+.2f} s off node "
                f"{nodes[0].name}'s (limit {limits.max_clock_skew_s:g} s); enable NTP "
                f"(chrony or systemd-timesyncd) on every node."
            )
    return out


def render(nodes: list[NodeFacts], bandwidth: dict[str, float], bad: list[str]) -> None:
    """A rich table, one row per node, then the all-reduce bandwidth per backend."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"disttrain check: {len(nodes)} node(s)")
    for col in ("rank", "node", "python", "torch", "disttrain", "GPUs", "nproc", "ckpt free", "clock offset", "status"):
        table.add_column(col)
    for n in nodes:
        mine = [p for p in bad if p.startswith(f"node {n.name}:")]
        free = (
            "-"
            if not n.ckpt_dir
            else "not writable"
            if n.ckpt_error
            else f"{n.ckpt_free_gib:.1f} GiB"
            if n.ckpt_free_gib is not None
            else "?"
        )
        clock = "-" if n.clock_offset_s is None else f"{n.clock_offset_s * 1000:+.1f} ms"
        status = "[green]ok[/]" if not mine else f"[red]{len(mine)} problem(s)[/]"
        table.add_row(
            str(n.rank), n.name, n.python, n.torch, n.disttrain, str(n.devices), str(n.nproc), free, clock, status
        )
    console = Console(width=140)
    console.print(table)
    for backend, gbps in bandwidth.items():
        console.print(f"all-reduce {backend}: {gbps:.2f} GB/s bus bandwidth across {len(nodes)} node(s)")
