"""`disttrain check`: a preflight on every node of a job that names what is wrong, in seconds.

Run it on each node with the flags of `disttrain run` (a trailing script, or
`-m disttrain.train CONFIG`, is accepted and only its config is read). Each node:
1. connects to the rendezvous endpoint (retrying until the deadline: the host's store
   may start a moment later) -- a node that cannot is named with the OS error;
2. joins a rendezvous of all `--nnodes` nodes (the upper bound of MIN:MAX) through
   torch's own handler for the backend (c10d, etcd-v2; static: one store at the
   endpoint, as torchrun's), under the run id `{rdzv-id}-check` so the job's own
   rendezvous state is never touched; a node that is still waiting at the deadline
   says how many nodes are missing. A store the check hosts listens only on the
   endpoint's address (`runtime.store_server`), not on every interface;
3. publishes its facts (versions, visible GPUs, free space and write access at the
   checkpoint directory) through the rendezvous store, so a version mismatch is named
   before any collective could hang on it;
4. starts a gloo process group on that store (plus an nccl group where every node has
   CUDA), times an all-reduce per backend and measures each clock against rank 0's.
Every node prints the same rich table; exit 0 when healthy, else one line per problem,
each naming the node (exit 2). Steps 1-3 share one `--timeout` (default 10 s) and the
process group gets another: a cut link is reported instead of a hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from disttrain.errors import UserError
from disttrain.launch.check_facts import Limits, NodeFacts, is_local_address, node_facts, problems, reach, render
from disttrain.launch.launch_files import OneLineParser
from disttrain.launch.run_command import DEFAULT_ENV, split_script

ALLREDUCE_BYTES = 8 * 1024 * 1024
ALLREDUCE_ITERS = 3
CLOCK_ROUNDS = 5
C10D_PORT = 29400  # torchrun's default for the c10d endpoint
STATIC_PORT = 29500  # torchrun's default --master-port


@dataclass(frozen=True)
class CheckArgs:
    """The job's shape as `disttrain run` would see it, plus the check's own limits."""

    nnodes: int
    nproc: int
    backend: str  # c10d | etcd-v2 | static
    host: str
    port: int
    run_id: str
    node_rank: int | None
    local_addr: str | None
    ckpt_dir: str
    timeout_s: float
    limits: Limits


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="disttrain check",
        description="Preflight of a multi-node job: run it on every node with the flags of `disttrain run`.",
    )
    p.add_argument("--nnodes", default="1")
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc", default=None)
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="backend", default=None)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="endpoint", default="")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="run_id", default="none")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None)
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None)
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=STATIC_PORT)
    p.add_argument("--local-addr", "--local_addr", dest="local_addr", default=None)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--config", default=None, help="trainer TOML: its checkpoint directory is checked")
    p.add_argument("--checkpoint-dir", default=None, help="directory to check (wins over --config)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per phase (default 10)")
    p.add_argument("--min-free-gib", type=float, default=1.0)
    p.add_argument("--max-clock-skew", type=float, default=2.0, help="seconds (default 2)")
    return p


def _int_flag(name: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{name} is {value!r}; give a positive whole number.")
    return int(value)


OWN_FLAGS = ("--config", "--checkpoint-dir", "--timeout", "--min-free-gib", "--max-clock-skew")


def _own_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take the check's own flags (and their values) out, so the rest splits at the
    script exactly as `disttrain run` splits it."""
    own, rest, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name in OWN_FLAGS:
            take = 1 if "=" in argv[i] else 2
            own += argv[i : i + take]
            i += take
        else:
            rest.append(argv[i])
            i += 1
    return own, rest


def parse(argv: list[str]) -> CheckArgs:
    """The check's arguments. Raises `UserError` for a bad value; torchrun flags the
    check has no use for (--max-restarts, --log-dir, ...) are ignored."""
    own, rest = _own_flags(argv)
    flags, script = split_script(rest)
    ns, unused = _parser().parse_known_args(flags + own)
    _refuse_unknown(unused)
    config, overrides = ns.config, []
    if script[:1] == ["disttrain.train"] and len(script) > 1 and config is None:
        config, overrides = script[1], script[2:]
    nnodes = _int_flag("--nnodes", ns.nnodes.split(":")[-1])  # MIN:MAX: every node launched
    if ns.nproc is None:
        from disttrain.launch.check_facts import visible_devices

        nproc = visible_devices() or 2  # as `disttrain run`
    else:
        nproc = _int_flag("--nproc-per-node", ns.nproc)
    if not ns.timeout > 0:
        raise UserError(f"--timeout is {ns.timeout:g}; give the positive number of seconds a phase may take.")
    backend = {"etcd": "etcd-v2", None: "static"}.get(ns.backend, ns.backend)
    if ns.standalone or (nnodes == 1 and not ns.endpoint and ns.master_addr is None):
        backend, endpoint = "c10d", ""  # a store of our own on a free local port
    elif backend == "static":
        endpoint = ns.endpoint or (f"{ns.master_addr}:{ns.master_port}" if ns.master_addr else "")
        if not endpoint or ns.node_rank is None:
            raise UserError(
                "a multi-node job without --rdzv-backend uses torchrun's static "
                "rendezvous: give --master-addr HOST and --node-rank N (or use "
                "--rdzv-backend c10d --rdzv-endpoint HOST:PORT)."
            )
    elif backend in ("c10d", "etcd-v2"):
        endpoint = ns.endpoint
        if not endpoint:
            raise UserError(
                f"--rdzv-backend {ns.backend} needs --rdzv-endpoint HOST:PORT, the address every node can reach."
            )
    else:
        raise UserError(
            f"--rdzv-backend {ns.backend!r} is not one the check knows; use c10d, etcd (etcd-v2) or static."
        )
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    default_port = {"c10d": C10D_PORT, "etcd-v2": 2379, "static": STATIC_PORT}[backend]
    if port and not port.isdigit():
        raise UserError(f"--rdzv-endpoint {endpoint!r} has no valid port; write it as HOST:PORT.")
    return CheckArgs(
        nnodes=nnodes,
        nproc=nproc,
        backend=backend,
        host=host or "127.0.0.1",
        port=int(port) if port else (0 if not endpoint else default_port),
        run_id=f"{ns.run_id}-check",
        node_rank=ns.node_rank,
        local_addr=ns.local_addr,
        ckpt_dir=_ckpt_dir(ns.checkpoint_dir, config, overrides),
        timeout_s=ns.timeout,
        limits=Limits(min_free_gib=ns.min_free_gib, max_clock_skew_s=ns.max_clock_skew),
    )


def _refuse_unknown(unused: list[str]) -> None:
    """Flags of torchrun's that the check does not need pass silently (the same command
    line serves both); any other flag is a typo."""
    from disttrain.runtime.torch_compat import torchrun_flags  # imports torch: only when asked

    torchrun = torchrun_flags()
    bad = [a for a in unused if a.startswith("--") and a.split("=", 1)[0] not in torchrun]
    if bad:
        raise UserError(f"unknown flag {bad[0]}; see `disttrain check --help` (torchrun's own flags are accepted too).")


def _ckpt_dir(explicit: str | None, config: str | None, overrides: list[str]) -> str:
    if explicit:
        return explicit
    if not config:
        return ""
    from disttrain.config import load_config
    from disttrain.train.resume_plan import checkpoint_root

    return str(checkpoint_root(load_config(config, overrides)))


class NodeFailed(UserError):
    """This node could not finish a phase; the message names it."""


STORE = "disttrain check's store"
"""How a warning names the stores the check hosts (`runtime.store_server`)."""


def _host_store(host: str, port: int, nnodes: int, timeout_s: float, **options):
    """The server of a store the check hosts at `host:port`, listening only on `host`'s
    address (`hosted_store`), not on every interface as torch's own would."""
    from disttrain.runtime.store_server import hosted_store

    return hosted_store(host, port, one_node=nnodes == 1, what=STORE, timeout_s=timeout_s, **options)


def _static(args: CheckArgs, hosting: bool, timeout_s: float):
    """torchrun's static rendezvous (node rank given, one store at the endpoint) ->
    RendezvousInfo; node rank 0 hosts the store (`_host_store`). A node that is missing
    is found when its facts do not arrive (`_exchange`)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    if hosting:
        store = _host_store(args.host, args.port, args.nnodes, timeout_s, wait_for_workers=False)
    else:
        store = dist.TCPStore(args.host, args.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    assert args.node_rank is not None, "parse requires --node-rank for static"
    where = RendezvousStoreInfo(args.host, args.port)
    return RendezvousInfo(dist.PrefixStore(args.run_id, store), args.node_rank, args.nnodes, where)


def _rendezvous(args: CheckArgs, addr: str, deadline: float, hosting: bool):
    """(handler, RendezvousInfo (store, rank, world)) through torch's rendezvous for the
    backend; a store this node hosts (c10d's, static's) listens only on the endpoint's
    address (`_host_store`)."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    left = max(1, int(deadline - time.monotonic()))
    if args.backend == "static":
        return None, _static(args, hosting, left)
    conf: dict = {
        "join_timeout": left,
        "last_call_timeout": 1,
        "read_timeout": left,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
    }
    if args.backend == "c10d":
        # torch guesses the store host from the hostname, which misses a secondary NIC or
        # a network namespace; binding to the endpoint's address is exact.
        conf["is_host"] = is_local_address(args.host)
    params = RendezvousParameters(
        backend=args.backend,
        endpoint=f"{args.host}:{args.port}",
        run_id=args.run_id,
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        local_addr=addr,
        **conf,
    )
    handler: RendezvousHandler
    if hosting:  # c10d: torch's handler, on a store bound to the endpoint's address
        store = _host_store(args.host, args.port, args.nnodes, left, wait_for_workers=False)
        handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    else:
        handler = get_rendezvous_handler(params)
    # The handler must outlive the check: it owns the store behind `info.store` (for
    # etcd-v2 a Python store, which a PrefixStore cannot use once it is collected).
    return handler, handler.next_rendezvous()


def _exchange(store, rank: int, world: int, mine: NodeFacts, hosting: bool, deadline: float) -> list[NodeFacts]:
    """Every node's facts, in rank order. The store's host returns only once every node
    has read them: its exit closes the store under a node still reading."""
    store.set(f"facts/{rank}", json.dumps(mine.to_json()))
    keys = [f"facts/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=max(1.0, deadline - time.monotonic())))
    nodes = [NodeFacts.from_json(json.loads(store.get(k))) for k in keys]
    store.add("facts-read", 1)
    while hosting and store.add("facts-read", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    return nodes


def _bus_gbps(backend: str, device: str, world: int) -> float:
    """All-reduce bus bandwidth (GB/s): 2(n-1)/n x bytes / time, nccl-tests' convention."""
    import torch
    import torch.distributed as dist

    group = None if backend == "gloo" else dist.new_group(backend=backend)
    x = torch.ones(ALLREDUCE_BYTES // 4, device=device)
    dist.all_reduce(x, group=group)  # warm-up: connections and buffers
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ALLREDUCE_ITERS):
        dist.all_reduce(x, group=group)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / ALLREDUCE_ITERS
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    return factor * ALLREDUCE_BYTES / seconds / 1e9


def _clock_offsets(world: int) -> list[float]:
    """Each node's wall clock minus rank 0's, the median over rounds that start at a
    barrier (error: the barrier's exit spread, well under a millisecond on a LAN)."""
    import torch
    import torch.distributed as dist

    rounds = []
    for _ in range(CLOCK_ROUNDS):
        dist.barrier()
        now = torch.tensor([time.time()], dtype=torch.float64)
        stamps = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(stamps, now)
        rounds.append([float(s) - float(stamps[0]) for s in stamps])
    return [statistics.median(r[i] for r in rounds) for i in range(world)]


def _collectives(info, nodes: list[NodeFacts], args: CheckArgs) -> dict[str, float]:
    """gloo (and nccl where every node has CUDA) on the rendezvous store (etcd-v2: on a
    TCPStore at rank 0's node): bandwidth per backend; each node's clock offset is
    written into `nodes`. Raises `NodeFailed` when the group cannot form in time."""
    import torch.distributed as dist

    store, rank, world = info.store, info.rank, len(nodes)
    me = nodes[rank]
    timeout = timedelta(seconds=args.timeout_s)
    try:
        if args.backend == "etcd-v2":  # as torchrun: a TCPStore on rank 0's node, not etcd, for the group
            where = info.bootstrap_store_info
            if rank == 0:
                store = _host_store(where.master_addr, where.master_port, world, args.timeout_s, world_size=world)
            else:
                store = dist.TCPStore(where.master_addr, where.master_port, world_size=world, timeout=timeout)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("check-pg", store), rank=rank, world_size=world, timeout=timeout
        )
    except Exception as e:  # gloo's own error types differ by version; all mean "no mesh"
        raise NodeFailed(
            f"node {me.name}: the nodes met at the store but gloo could not connect "
            f"them within {args.timeout_s:g} s ({_first_line(e)}). Set "
            f"GLOO_SOCKET_IFNAME to the interface of the network between the nodes."
        ) from None
    try:
        gbps: dict[str, float] = {}
        if world > 1:  # one node has no network between nodes to measure
            gbps["gloo"] = _bus_gbps("gloo", "cpu", world)
        if world > 1 and all(n.devices for n in nodes):
            import torch

            torch.cuda.set_device(0)
            gbps["nccl"] = _bus_gbps("nccl", "cuda", world)
        for n, offset in zip(nodes, _clock_offsets(world), strict=False):
            n.clock_offset_s = offset
        dist.barrier()  # nobody leaves (closing the store's host) before all are done
    finally:
        dist.destroy_process_group()
    return gbps


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def check(args: CheckArgs, started: float | None = None) -> tuple[list[NodeFacts], dict[str, float], list[str]]:
    """Run the phases on this node; returns (every node's facts, bandwidth, problems).
    Raises `NodeFailed` naming this node when it cannot reach the others within
    `args.timeout_s` of `started` (time.monotonic(); default now: torch's import counts)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    deadline = (time.monotonic() if started is None else started) + args.timeout_s
    port = args.port
    if args.backend == "c10d" and not port:  # one node: a free local port for the store
        from disttrain.launch.etcd_server import free_port

        port = free_port()
    args = dataclasses.replace(args, port=port)
    hosting = args.backend in ("c10d", "static") and (
        is_local_address(args.host) if args.backend == "c10d" else args.node_rank == 0
    )
    if hosting:
        addr = args.local_addr or args.host
    else:
        try:
            addr = reach(args.host, args.port, deadline)
        except OSError as e:
            who = f"{args.local_addr} ({_own_name()})" if args.local_addr else _own_name()
            raise NodeFailed(
                f"node {who}: cannot reach the rendezvous endpoint {args.host}:{args.port} "
                f"within {args.timeout_s:g} s ({e.strerror or e}); check this node's "
                f"link, route and firewall to {args.host}."
            ) from None
        addr = args.local_addr or addr
    mine = node_facts(addr, args.nproc, args.ckpt_dir)
    try:
        handler, info = _rendezvous(args, addr, deadline, hosting)
    except RendezvousTimeoutError:
        raise NodeFailed(
            f"node {mine.name}: not all {args.nnodes} nodes joined the rendezvous at "
            f"{args.host}:{args.port} within {args.timeout_s:g} s; a missing node cannot "
            f"reach it or was not started (its own `disttrain check` names why)."
        ) from None
    except Exception as e:  # a store that went away, refused connections: torch's types vary
        raise NodeFailed(
            f"node {mine.name}: the rendezvous at {args.host}:{args.port} failed: {_first_line(e)}"
        ) from None
    mine.rank = info.rank
    try:
        nodes = _exchange(info.store, info.rank, info.world_size, mine, hosting, deadline)
    except Exception as e:
        raise NodeFailed(
            f"node {mine.name}: the other nodes' facts did not arrive through the store "
            f"within {args.timeout_s:g} s ({_first_line(e)})."
        ) from None
    bad = problems(nodes, args.limits)
    gbps: dict[str, float] = {}
    if not bad:  # mismatched versions could hang a collective: only healthy nodes go on
        gbps = _collectives(info, nodes, args)
        bad = problems(nodes, args.limits)
    del handler  # kept alive until here on purpose
    return nodes, gbps, bad


def _own_name() -> str:
    import socket

    return socket.gethostname()


def main(argv: list[str]) -> int:
    """`disttrain check [run flags] [script | -m disttrain.train CONFIG]`: 0 when healthy;
    otherwise a `UserError` with one line per problem (exit 2)."""
    started = time.monotonic()
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the store's retry chatter; before torch loads
    # As `disttrain run` sets for its agents: rank 0's node serves a fresh TCPStore for the
    # group (its address and port come with the rendezvous), as the job's workers will use.
    os.environ.update(DEFAULT_ENV)
    args = parse(argv)
    nodes, gbps, bad = check(args, started)
    render(nodes, gbps, bad)
    if bad:
        raise UserError("\n".join(bad))
    print(f"disttrain check: {len(nodes)} node(s) healthy.", file=sys.stderr)
    return 0
