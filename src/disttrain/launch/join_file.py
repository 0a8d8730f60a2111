"""`disttrain launch-file k8s CONFIG --nodes N --join`: the manifest of one node that joins
the running PyTorchJob of the same --name and config (docs/cluster.md "A node that joins a
running job").

The file holds one object, a `batch/v1` Job of one pod: the PyTorchJob worker's own pod
(image, config and claim mounts, resources, `SECRET_ENV` from the job's Secret) whose
`disttrain run` is the worker's command plus `--join` (`launch.join_flags`). It is named
by `generateName`, so each `kubectl create -f` adds one more node. It makes no etcd,
ConfigMap, Secret or PyTorchJob: those of the job's own file are used.

A join needs the etcd rendezvous, fast recovery, a fixed world and the job's secret, so
`check_join` refuses the sbatch file (c10d), a config without fast recovery, an elastic
range and a one-node job (whose launcher makes a secret of its own) in one line each.
"""

from __future__ import annotations

import argparse
import json

from disttrain.errors import UserError
from disttrain.launch.join_flags import JOIN_FLAG
from disttrain.launch.launch_templates import LaunchSpec, pytorchjob, secret_name
from disttrain.launch.run_help import SPARE_NODES_FLAG
from disttrain.runtime.job_secret import SECRET_ENV


def check_join(ns: argparse.Namespace, fast_recovery: bool) -> None:
    """Raise `UserError` (one line) when `--join` is asked for a node that could not join:
    a Slurm file, a config without fast recovery, `--min-nodes` other than `--nodes`, or
    a job of one node and no spares. Nothing without `--join`."""
    if not ns.join:
        return
    if ns.kind == "slurm":
        raise UserError(
            f"{JOIN_FLAG} is for k8s: the sbatch file's c10d rendezvous lives on the job's first node, at an "
            f"address a new node does not know; run the job on --rdzv-backend etcd and add a node with "
            f"disttrain run {JOIN_FLAG} plus the job's command (docs/cluster.md)."
        )
    if not fast_recovery:
        raise UserError(
            f"{JOIN_FLAG} needs fast recovery (the joined slots take the state in memory): "
            f"set [elastic] fast_recovery = true in {ns.config}."
        )
    if ns.min_nodes is not None and ns.min_nodes != ns.nodes:
        raise UserError(
            f"{JOIN_FLAG} adds a node to the fixed world of a fast-recovery job; drop --min-nodes "
            f"(give the job's own --nodes and --spare-nodes)."
        )
    if ns.nodes + max(ns.spare_nodes, 0) == 1:
        raise UserError(
            f"{JOIN_FLAG}: a one-node job's launcher makes its own {SECRET_ENV}, which a joining node cannot "
            f"have; write and start the job with --nodes 2 or more, or --spare-nodes 1, so its pods share one."
        )


def join_command(worker: list[str]) -> list[str]:
    """The PyTorchJob worker's `disttrain run ...` command with `--join` among `run`'s
    flags (after the script it would be the script's), less `--spare-nodes K`, which a
    joining node's run refuses: it is one more node, not a spare."""
    flags = list(worker[2:])
    if SPARE_NODES_FLAG in flags:
        i = flags.index(SPARE_NODES_FLAG)
        del flags[i : i + 2]
    return [*worker[:2], JOIN_FLAG, *flags]


def join_job(s: LaunchSpec) -> dict:
    """A `batch/v1` Job of one pod: the worker pod of `pytorchjob(s)` running
    `join_command`. A pod that fails is not retried (`backoffLimit` 0): a node that
    could not join says why in its log, and another create adds another node."""
    worker = pytorchjob(s)["spec"]["pytorchReplicaSpecs"]["Worker"]
    template = worker["template"]
    container = template["spec"]["containers"][0]
    container["command"] = join_command(container["command"])
    template["spec"]["restartPolicy"] = "Never"  # a Job's pod: Never or OnFailure, no Always
    meta: dict = {
        "generateName": f"{s.name}-join-",
        "labels": {"app.kubernetes.io/part-of": s.name, "app.kubernetes.io/component": "join"},
    }
    if s.namespace:
        meta["namespace"] = s.namespace
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {"backoffLimit": 0, "template": template},
    }


def join_note(s: LaunchSpec) -> str:
    """The file's header: what it is, that each create adds a node, and what it uses."""
    return (
        "# Written by `disttrain launch-file k8s --join`: one node that joins a running job.\n"
        "# Each `kubectl create -f` of this file adds one more node (create, not apply: the name is generated).\n"
        f"# It joins the PyTorchJob {s.name}, already running from its own file (launch-file k8s without\n"
        f"# {JOIN_FLAG}): a Job of one pod, {s.name}-join-XXXXX, runs the job's worker command plus {JOIN_FLAG};\n"
        "# its slots stand by warm and are admitted at a step boundary (docs/elastic.md). It creates\n"
        f"# no etcd, ConfigMap, Secret or PyTorchJob: it uses the job's Service {s.name}-etcd, ConfigMap\n"
        f"# {s.name}-config and Secret {secret_name(s)}. A pod that fails is not retried: create again.\n"
    )


def join_manifest(s: LaunchSpec) -> str:
    """The file `launch-file k8s --join` writes: `join_note`, then `join_job` as one JSON document."""
    return f"{join_note(s)}---\n{json.dumps(join_job(s), indent=2)}\n"
