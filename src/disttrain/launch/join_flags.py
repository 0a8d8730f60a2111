"""`disttrain run --join`: the torchrun flags and environment of a node that joins a
running fast-recovery job (`elastic.join_node`).

The joining node is given the job's own command plus `--join`. It must not enter the
job's torchrun rendezvous (the agents would restart every worker for the new node), so
its torchrun runs standalone, and its slot supervisors find the job on the etcd by the
job's run id. Imports no torch: the launcher parses its arguments before torch loads.
"""

from __future__ import annotations

from disttrain.errors import UserError

JOIN_FLAG = "--join"
RUN_ENV = "DISTTRAIN_JOIN_RUN"  # elastic.join_node.RUN_ENV; not imported: that imports torch
FAST_STORE_ENV = "DISTTRAIN_FAST_STORE"  # elastic.etcd_store.STORE_ENV
RDZV_FLAGS = ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--nnodes", "--node-rank")
"""The job's node flags, which a joining node's own torchrun does not take (both spellings)."""


def _without_node_flags(flags: list[str]) -> list[str]:
    names = {n for f in RDZV_FLAGS for n in (f, f.replace("-", "_").replace("__", "--"))}
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
        elif f in names and i + 1 < len(flags):
            skip = True
        elif f.split("=", 1)[0] not in names and f != "--standalone":
            out.append(f)
    return out


def take_join(
    flags: list[str], spare_nodes: str | None, rdzv: tuple[str | None, str | None, str | None]
) -> tuple[list[str], dict[str, str]]:
    """`flags` for the joining node's own torchrun (the job's node and rendezvous flags
    taken out) and the environment that points its slots at the job; `flags` unchanged
    and no environment without `--join`. `rdzv`: the values of the job's
    `--rdzv-backend`, `--rdzv-endpoint` and `--rdzv-id` in `flags`. Raises `UserError`
    when the job cannot be found from them (no etcd rendezvous, no endpoint or run id)
    or with `--spare-nodes`."""
    if JOIN_FLAG not in flags:
        return flags, {}
    flags = [f for f in flags if f != JOIN_FLAG]
    backend, endpoint, run_id = rdzv
    if backend not in ("etcd", "etcd-v2") or not endpoint or not run_id:
        raise UserError(
            f"{JOIN_FLAG} adds this node to a running fast-recovery job on the etcd rendezvous: give the job's "
            f"own --rdzv-backend etcd --rdzv-endpoint HOST:PORT --rdzv-id ID (its command, plus {JOIN_FLAG})."
        )
    if spare_nodes is not None:
        raise UserError(f"{JOIN_FLAG} adds one node to a running job; leave out --spare-nodes on the joining node.")
    env = {RUN_ENV: run_id, FAST_STORE_ENV: "etcd://" + endpoint.split(",")[0].removeprefix("http://")}
    return _without_node_flags(flags), env
