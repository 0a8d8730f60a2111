"""The text of the launch files `disttrain launch-file` writes: a Slurm batch script and
the objects of a Kubernetes PyTorchJob (Kubeflow training operator, `kubeflow.org/v1`).

Pure functions of a `LaunchSpec`; no file is read or written here.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from disttrain.runtime.job_secret import SECRET_ENV

ETCD_PORT = 2379
C10D_PORT = 29400
POD_CONFIG = "/etc/disttrain/config.toml"
POD_SHARED = "/shared"
# A SIGTERM before the time limit must leave the grace, torchrun's margin and the
# requeue itself: grace + SHUTDOWN_MARGIN_S + this many seconds.
REQUEUE_SLACK_S = 30


@dataclass(frozen=True)
class LaunchSpec:
    """One job: `min_nodes`..`nodes` nodes of `nproc` processes each, training `config`,
    plus `spares` hot-spare nodes (then `min_nodes == nodes`: a fixed world)."""

    config: str  # path on the cluster's shared filesystem (Slurm) or the TOML text (k8s)
    name: str
    nodes: int
    min_nodes: int
    nproc: int
    gpus: int
    max_restarts: int
    grace_s: int  # elastic.preempt_grace_s + SHUTDOWN_MARGIN_S, rounded up
    partition: str = ""
    time: str = ""
    check: bool = True
    image: str = ""
    etcd_image: str = ""
    namespace: str = ""
    pvc: str = ""
    spares: int = 0
    fast_recovery: bool = False  # the config's [elastic] fast_recovery


def fast_on_nodes(s: LaunchSpec) -> bool:
    """Fast recovery on more than one node: every node's `disttrain run` needs the same
    `SECRET_ENV`, and a lost node is survived in memory (so Slurm must not end the job)."""
    return s.fast_recovery and s.nodes + s.spares > 1


def secret_name(s: LaunchSpec) -> str:
    """The Kubernetes Secret whose key `secret` the workers take `SECRET_ENV` from."""
    return f"{s.name}-job-secret"


def secret_command(s: LaunchSpec) -> str:
    """The one command that creates `secret_name` with a random value. The value goes
    through a pipe, not kubectl's command line (other users see command lines in ps)."""
    namespace = f" --namespace {shlex.quote(s.namespace)}" if s.namespace else ""
    return (
        "python3 -c 'import secrets; print(secrets.token_hex(32), end=\"\")' | kubectl create secret "
        f"generic {secret_name(s)}{namespace} --from-file=secret=/dev/stdin"
    )


def secret_note(s: LaunchSpec) -> str:
    """The comment the manifest carries above the PyTorchJob when its workers need the Secret."""
    return (
        f"# The workers take {SECRET_ENV} (fast recovery's store accepts only values sealed with it)\n"
        f"# from the Secret {secret_name(s)}, key 'secret', which this file does not hold.\n"
        f"# Create it once, with a random value, before you apply this file:\n"
        f"#   {secret_command(s)}\n"
    )


def _node_flags(s: LaunchSpec) -> str:
    """`disttrain run`'s node flags: the training nodes, and the spares when there are any."""
    return f"--nnodes {s.nodes}" + (f" --spare-nodes {s.spares}" if s.spares else "")


def _no_kill(s: LaunchSpec) -> str:
    """srun's flag that keeps the training step on the other nodes when one node fails
    (#SBATCH --no-kill keeps only the allocation): fast recovery goes on without it."""
    return " --no-kill" if fast_on_nodes(s) else ""


def _sbatch_secret(s: LaunchSpec) -> list[str]:
    """Lines that export one fresh job secret to every node's `disttrain run` (srun's tasks
    inherit the script's environment); a requeued start, a new attempt, makes a new one."""
    if not fast_on_nodes(s):
        return []
    return [
        f"# Fast recovery on several nodes: every node's disttrain run needs the same {SECRET_ENV}.",
        "# A fresh one for each start, handed to srun's tasks in the environment (not on a",
        "# command line, which other users see in ps, and not in this file).",
        f"{SECRET_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')",
        f"export {SECRET_ENV}",
        "",
    ]


def _directives(s: LaunchSpec) -> list[str]:
    """The script's first lines: what it is, and its #SBATCH directives (N + spares nodes)."""
    spares = f", plus {s.spares} hot-spare node(s)" if s.spares else ""
    lines = [
        "#!/bin/bash",
        f"# Written by `disttrain launch-file slurm`: {s.nodes} node(s) x {s.nproc} process(es){spares}.",
        "# Submit from the environment disttrain is installed in (sbatch exports it to srun).",
        f"#SBATCH --job-name={s.name}",
        f"#SBATCH --nodes={s.nodes + s.spares}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if fast_on_nodes(s):  # Slurm's default ends the whole job when one node fails
        lines += ["# A failed node does not end the job: fast recovery goes on without it.", "#SBATCH --no-kill"]
    if s.gpus:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus}")
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.time:
        lines.append(f"#SBATCH --time={s.time}")
    return lines + [
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={s.name}-%j.out",
        "# SIGTERM to this script before the time limit: enough for the save and the requeue.",
        f"#SBATCH --signal=B:TERM@{s.grace_s + REQUEUE_SLACK_S}",
    ]


def sbatch(s: LaunchSpec) -> str:
    """A batch script: one `disttrain run` per node under srun, the c10d rendezvous on the
    allocation's first node, a `disttrain check` first, and SIGTERM -> save -> exit 0 ->
    `scontrol requeue` (the next start resumes from the checkpoint just written)."""
    lines = [
        *_directives(s),
        "set -euo pipefail",
        "",
        f"config={shlex.quote(s.config)}",
        "# The rendezvous (torch's c10d store) runs on the first node of the allocation.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'run_flags=(--nproc-per-node {s.nproc} --rdzv-backend c10d --rdzv-endpoint "$head_node:{C10D_PORT}"',
        '           --rdzv-id "$SLURM_JOB_ID")',
        "",
        *_sbatch_secret(s),
    ]
    if s.check:
        lines += [
            "# Preflight: every node reaches the rendezvous, versions and GPU counts agree, the",
            "# checkpoint directory is writable. A broken node is named here within seconds.",
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 disttrain check --nnodes {s.nodes + s.spares} "
            '"${run_flags[@]}" --config "$config"',
            "",
        ]
    if s.spares:
        lines += [
            f"# {s.spares} node(s) stand by with warm processes; one takes a lost node's ranks in memory.",
            "# Any node but the first can be lost: it hosts the c10d rendezvous, so losing it ends the job.",
        ]
    lines += [
        "# Preemption (or the time limit's SIGTERM above): every rank finishes its step, saves",
        "# and exits 0; then the job is requeued and the same command resumes.",
        "preempted=0",
        "# scancel --signal (not --batch) passes SIGTERM to the step's processes without",
        "# cancelling it: srun itself would cancel the step on a SIGTERM of its own.",
        'trap \'preempted=1; echo "disttrain: SIGTERM: saving, then requeueing job $SLURM_JOB_ID" >&2; '
        'scancel --signal=TERM "$SLURM_JOB_ID" || true\' TERM',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0{_no_kill(s)} disttrain run {_node_flags(s)} "
        '"${run_flags[@]}" '
        f'--max-restarts {s.max_restarts} -m disttrain.train "$config" &',
        "train_pid=$!",
        "rc=0",
        'wait "$train_pid" || rc=$?',
        'if [ "$preempted" -eq 1 ]; then',
        "  # The ranks save and exit 0; torchrun's agent itself exits 1 on its SIGTERM.",
        '  wait "$train_pid" || true',
        '  scontrol requeue "$SLURM_JOB_ID" || true  # already queued again under PreemptMode=REQUEUE',
        "  rc=0",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _meta(s: LaunchSpec, name: str, **labels: str) -> dict:
    meta: dict = {"name": name, "labels": {"app.kubernetes.io/part-of": s.name, **labels}}
    if s.namespace:
        meta["namespace"] = s.namespace
    return meta


ETCD_NOTE = """\
# The etcd below has no authentication and no TLS: any pod that reaches it can read and
# rewrite the rendezvous (torch keeps its etcd-v2 rendezvous state there as a pickle).
# It listens only on its pod's own address (clients, port 2379, reached through the
# Service) and on 127.0.0.1 (peers: it is a cluster of one). Restrict which pods reach
# it with a NetworkPolicy. To require client certificates, see "Protect etcd with its
# own options" in disttrain's docs/security.md: add --cert-file, --key-file,
# --client-cert-auth and --trusted-ca-file with https:// client URLs here, mount the
# files from a Secret, and give the workers' command --rdzv-conf
# protocol=https,ca_cert=CA,ssl_cert=CERT,ssl_cert_key=KEY.
"""
"""The comment the manifest carries above the etcd Deployment (`etcd_objects`)."""


def etcd_objects(s: LaunchSpec) -> list[dict]:
    """A one-replica etcd (v2 API on: torch's etcd-v2 rendezvous speaks it) and its
    Service. etcd listens for clients on its pod's address only (the downward API's
    status.podIP), not on every interface of the pod, and for peers on 127.0.0.1.
    Without authentication: see `ETCD_NOTE`."""
    name = f"{s.name}-etcd"
    labels = {"app.kubernetes.io/name": name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(s, name, **labels),
        "spec": {"selector": labels, "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT}]},
    }
    container = {
        "name": "etcd",
        "image": s.etcd_image,
        "command": [
            "etcd",
            "--enable-v2=true",
            "--data-dir=/var/lib/etcd",
            f"--listen-client-urls=http://$(POD_IP):{ETCD_PORT}",  # Kubernetes expands $(POD_IP)
            f"--advertise-client-urls=http://{name}:{ETCD_PORT}",
            "--listen-peer-urls=http://127.0.0.1:2380",  # a cluster of one has no peers to hear
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"containerPort": ETCD_PORT, "name": "client"}],
        "readinessProbe": {"tcpSocket": {"port": ETCD_PORT}, "periodSeconds": 2},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(s, name, **labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    return [service, deployment]


def config_map(s: LaunchSpec, toml_text: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(s, f"{s.name}-config"),
        "data": {"config.toml": toml_text},
    }


def pytorchjob(s: LaunchSpec) -> dict:
    """Elastic workers (min..max replicas) that each run `disttrain run` against the etcd
    Service; the config comes from the ConfigMap, checkpoints go to the claim `pvc`. With
    spares: a fixed N + spares replicas, `--nnodes N --spare-nodes K`. Under `fast_on_nodes`:
    `SECRET_ENV` from the Secret `secret_name` (made by `secret_command`, not by this file)."""
    endpoint = f"{s.name}-etcd:{ETCD_PORT}"
    overrides = [f"--train.out_dir={POD_SHARED}/out"] if s.pvc else []
    nodes = [str(s.nodes), "--spare-nodes", str(s.spares)] if s.spares else [f"{s.min_nodes}:{s.nodes}"]
    replicas = s.nodes + s.spares
    command = [
        "disttrain",
        "run",
        "--nnodes",
        *nodes,
        "--nproc-per-node",
        str(s.nproc),
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        s.name,
        "--max-restarts",
        str(s.max_restarts),
        "-m",
        "disttrain.train",
        POD_CONFIG,
        *overrides,
    ]
    mounts = [{"name": "config", "mountPath": "/etc/disttrain", "readOnly": True}]
    volumes: list[dict] = [{"name": "config", "configMap": {"name": f"{s.name}-config"}}]
    if s.pvc:
        mounts.append({"name": "shared", "mountPath": POD_SHARED})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": s.pvc}})
    container: dict = {"name": "pytorch", "image": s.image, "command": command, "volumeMounts": mounts}
    if s.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": s.gpus}}
    if fast_on_nodes(s):  # the same on every worker, from a Secret the user made: never in this file
        key = {"secretKeyRef": {"name": secret_name(s), "key": "secret"}}
        container["env"] = [{"name": SECRET_ENV, "valueFrom": key}]
    pod = {
        "metadata": {"labels": {"app.kubernetes.io/part-of": s.name}},
        "spec": {
            "containers": [container],
            "volumes": volumes,
            # SIGTERM -> every rank saves within the grace -> exit 0, before SIGKILL.
            "terminationGracePeriodSeconds": s.grace_s + 5,
        },
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _meta(s, s.name),
        "spec": {
            "elasticPolicy": {
                "minReplicas": s.min_nodes + s.spares,
                "maxReplicas": replicas,
                "maxRestarts": s.max_restarts,
                "rdzvBackend": "etcd-v2",
                "rdzvHost": f"{s.name}-etcd",
                "rdzvPort": ETCD_PORT,
                "rdzvId": s.name,
                "nProcPerNode": s.nproc,
            },
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {"Worker": {"replicas": replicas, "restartPolicy": "OnFailure", "template": pod}},
        },
    }
