"""`disttrain launch-file slurm|k8s CONFIG.toml --nodes N ...`: write a cluster's launch file.

slurm: an sbatch script (see `launch_templates.sbatch`): srun starts one `disttrain run`
       per node, the c10d rendezvous sits on the allocation's first node, a `disttrain
       check` step runs first (--no-check drops it), and SIGTERM (preemption, or shortly
       before --time runs out) makes every rank save and exit 0 before `scontrol requeue`.
k8s:   a Kubeflow PyTorchJob (kubeflow.org/v1) with elastic min..max replicas, an etcd
       Deployment and Service for torch's etcd-v2 rendezvous, and a ConfigMap holding the
       TOML; `--pvc CLAIM` mounts a shared volume for the run's output and checkpoints.

`--join` (k8s, under `[elastic] fast_recovery`): instead, the manifest of one node that
joins the running PyTorchJob of the same --name and config (`launch.join_file`); each
`kubectl create -f NAME-join.yaml` adds one node. The sbatch file cannot be joined.

`--spare-nodes K` (under `[elastic] fast_recovery`) adds K hot-spare nodes to a fixed
world of --nodes N: both files start N + K nodes that each run `disttrain run --nnodes N
--spare-nodes K`. Fast recovery on more than one node needs one DISTTRAIN_JOB_SECRET on
every node: the sbatch script exports a fresh one, the PyTorchJob takes it from a Secret
the user creates (the command is in the file and printed); its value is never written.

The config is loaded and validated first, so a typo fails here, not on the cluster.
Every mistake is a `UserError` naming the flag. The file is written to --output
(default NAME.sbatch / NAME.yaml / NAME-join.yaml); `-o -` prints it. The k8s file is one JSON document
per object, separated by `---`: JSON is YAML, and it needs no YAML library.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from disttrain.config.paths import output_file
from disttrain.errors import UserError
from disttrain.launch.join_file import check_join, join_manifest
from disttrain.launch.launch_templates import (
    ETCD_NOTE,
    POD_CONFIG,
    POD_SHARED,
    LaunchSpec,
    config_map,
    etcd_objects,
    fast_on_nodes,
    pytorchjob,
    sbatch,
    secret_command,
    secret_note,
)
from disttrain.launch.run_command import SHUTDOWN_MARGIN_S

DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"  # 3.5 still serves the v2 API torch needs
SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")  # M, M:S, H:M:S, D-H, D-H:M[:S]
SLURM_PARTITION = re.compile(r"^[\w.-]+(,[\w.-]+)*$")  # a name, or a comma-separated list of names
K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$")  # a DNS label, room for '-etcd'


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises `UserError` (one line, exit 2) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UserError(f"{message}. See: {self.prog} --help")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="disttrain launch-file", description="Write a Slurm sbatch script or a Kubernetes PyTorchJob."
    )
    p.add_argument("kind", choices=("slurm", "k8s"))
    p.add_argument("config", help="the trainer's TOML (validated now)")
    p.add_argument("--nodes", type=int, required=True, help="nodes (k8s: the most replicas)")
    p.add_argument("--min-nodes", type=int, default=None, help="k8s: the fewest replicas (default --nodes)")
    p.add_argument(
        "--spare-nodes", type=int, default=0, help="hot-spare nodes beyond --nodes (needs [elastic] fast_recovery)"
    )
    p.add_argument("--gpus-per-node", type=int, default=0, help="0 on CPU nodes (then parallel.nproc processes)")
    p.add_argument("--partition", default="")
    p.add_argument("--time", default="", help="Slurm time limit, e.g. 04:00:00 or 1-00:00:00")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--name", default="", help="job name (default: the config's file name)")
    p.add_argument("--no-check", action="store_true", help="slurm: no `disttrain check` step")
    p.add_argument("--image", default="", help="k8s: the container image with disttrain installed")
    p.add_argument("--etcd-image", default=DEFAULT_ETCD_IMAGE)
    p.add_argument("--namespace", default="")
    p.add_argument("--pvc", default="", help="k8s: a ReadWriteMany claim for output and checkpoints")
    p.add_argument(
        "--join", action="store_true", help="k8s: one node that joins the running job (kubectl create -f per node)"
    )
    p.add_argument("-o", "--output", default="", help="file to write; '-' prints it")
    return p


def slurm_seconds(text: str) -> int:
    """Seconds of a Slurm time limit (MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS).
    Raises `UserError` for another form, a field out of range (minutes or seconds over
    59, hours over 23 after days) or a limit of zero."""
    m = SLURM_TIME.match(text)
    bad = f"--time {text!r} is not a Slurm time limit; write MINUTES, HH:MM:SS or D-HH:MM:SS"
    if not m:
        raise UserError(bad + ".")
    days, first, second, third = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, se = int(first), int(second or 0), int(third or 0)
        total, ok = ((int(days) * 24 + h) * 60 + mi) * 60 + se, h < 24 and mi < 60 and se < 60
    elif third is not None:  # H:M:S
        h, mi, se = int(first), int(second), int(third)
        total, ok = (h * 60 + mi) * 60 + se, mi < 60 and se < 60
    elif second is not None:  # M:S
        total, ok = int(first) * 60 + int(second), int(second) < 60
    else:  # M
        total, ok = int(first) * 60, True
    if not ok:
        raise UserError(bad + " (minutes and seconds at most 59, hours at most 23 after days).")
    if total <= 0:
        raise UserError(f"--time {text!r} is no time at all; give the job's limit, e.g. 04:00:00.")
    return total


def _one_line(flag: str, value: str) -> None:
    """A value written into the launch file must be one line of printable text: a newline
    would start another #SBATCH directive or shell command (an injection)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UserError(f"{flag} {value!r} contains a newline or another control character; give it on one line.")


def spec_from(ns: argparse.Namespace) -> tuple[LaunchSpec, str]:
    """The job and the config's text. Raises `UserError`/`ConfigError` for any bad value."""
    from disttrain.config import load_config

    cfg = load_config(ns.config)  # ConfigError names the file and the key
    if ns.nodes < 1:
        raise UserError(f"--nodes is {ns.nodes}; a job needs at least one node.")
    check_join(ns, cfg.elastic.fast_recovery)
    min_nodes = ns.nodes if ns.min_nodes is None else ns.min_nodes
    if not 1 <= min_nodes <= ns.nodes:
        raise UserError(f"--min-nodes {min_nodes} must be between 1 and --nodes {ns.nodes}.")
    if ns.kind == "slurm" and min_nodes != ns.nodes:
        raise UserError("--min-nodes is for k8s; a Slurm allocation has a fixed node count.")
    spares = spare_nodes(ns, cfg.elastic.fast_recovery)
    if ns.gpus_per_node < 0 or ns.max_restarts < 0:
        raise UserError("--gpus-per-node and --max-restarts must be >= 0.")
    for flag in ("partition", "time", "name", "image", "etcd_image", "namespace", "pvc", "config"):
        _one_line(f"--{flag.replace('_', '-')}" if flag != "config" else "the config path", getattr(ns, flag))
    if ns.partition and not SLURM_PARTITION.match(ns.partition):
        raise UserError(
            f"--partition {ns.partition!r} is not a Slurm partition name; use letters, "
            f"digits, '_', '.', '-' (several: comma-separated)."
        )
    grace = math.ceil(cfg.elastic.preempt_grace_s) + SHUTDOWN_MARGIN_S
    if ns.time and slurm_seconds(ns.time) <= grace:
        raise UserError(
            f"--time {ns.time!r} is not longer than the {grace} s the job needs to save "
            f"on its SIGTERM (elastic.preempt_grace_s + {SHUTDOWN_MARGIN_S} s); give more time."
        )
    name = _job_name(ns)
    if ns.kind == "k8s" and not ns.image:
        raise UserError("k8s needs --image IMAGE: a container image with disttrain and your code installed.")
    if ns.kind == "k8s":
        _pod_paths(ns.config, ns.pvc)
    config = str(Path(ns.config).resolve()) if ns.kind == "slurm" else ns.config
    spec = LaunchSpec(
        config=config,
        name=name,
        nodes=ns.nodes,
        min_nodes=min_nodes,
        nproc=ns.gpus_per_node or cfg.parallel.nproc,
        gpus=ns.gpus_per_node,
        max_restarts=ns.max_restarts,
        grace_s=grace,
        partition=ns.partition,
        time=ns.time,
        check=not ns.no_check,
        image=ns.image,
        etcd_image=ns.etcd_image,
        namespace=ns.namespace,
        pvc=ns.pvc,
        spares=spares,
        fast_recovery=cfg.elastic.fast_recovery,
    )
    return spec, Path(ns.config).read_text()


def _job_name(ns: argparse.Namespace) -> str:
    """--name, else the config's file name; `UserError` for one the cluster cannot take."""
    name = ns.name or Path(ns.config).stem.replace("_", "-").lower()
    if ns.kind == "k8s" and not K8S_NAME.match(name):
        raise UserError(
            f"job name {name!r} is not a Kubernetes name; pass --name with lower-case "
            f"letters, digits and '-' (at most 42 characters)."
        )
    if ns.kind == "slurm" and not re.match(r"^[\w.-]+$", name):
        raise UserError(f"job name {name!r} has characters Slurm file names cannot take; pass --name.")
    return name


def spare_nodes(ns: argparse.Namespace, fast_recovery: bool) -> int:
    """The hot-spare node count of --spare-nodes. Raises `UserError` for a negative count,
    spares without fast recovery (a spare takes a lost node's ranks in memory), or spares
    with --min-nodes (they replace lost nodes of a fixed world, not an elastic range)."""
    k = ns.spare_nodes
    if k < 0:
        raise UserError(f"--spare-nodes is {k}; give the number of standby nodes (0: none).")
    if k and ns.min_nodes is not None:
        raise UserError(
            "--spare-nodes takes a lost node's place in a fixed world of --nodes; drop --min-nodes "
            "(an elastic range and spares do not mix)."
        )
    if k and not fast_recovery:
        raise UserError(
            f"--spare-nodes needs fast recovery (a spare takes a lost node's ranks in memory): "
            f"set [elastic] fast_recovery = true in {ns.config}."
        )
    return k


def _pod_paths(config: str, pvc: str) -> None:
    """Refuse (`UserError`) a relative path key in a TOML bound for k8s: in the pod the TOML
    is `POD_CONFIG`, and a relative path is taken from its folder, a read-only ConfigMap
    mount. train.out_dir is exempt under --pvc, which sets it on the claim."""
    from disttrain.config.path_keys import PATH_KEYS
    from disttrain.config.tomlfile import read_toml

    raw = read_toml(config)
    for key in PATH_KEYS:
        section, name = key.split(".")
        table = raw.get(section)
        value = table.get(name) if isinstance(table, dict) else None
        if (key == "train.out_dir" and pvc) or not isinstance(value, str) or not value.strip():
            continue
        if not Path(value).is_absolute() and not value.startswith("~"):
            raise UserError(
                f"{key} = {value!r} in {config} is relative, so in the pod it would be under "
                f"{Path(POD_CONFIG).parent}, the read-only config mount; give a path in the pod "
                f"from /, e.g. on the claim --pvc mounts at {POD_SHARED}."
            )


def render(ns: argparse.Namespace) -> tuple[str, str, str]:
    """(file text, default file name, the command that must run before the file is
    applied: the k8s job secret's, or "") for the parsed arguments."""
    spec, toml_text = spec_from(ns)
    if ns.kind == "slurm":
        return sbatch(spec), f"{spec.name}.sbatch", ""
    if ns.join:  # the job's file made the etcd, the ConfigMap and the PyTorchJob; the user, the Secret
        return join_manifest(spec), f"{spec.name}-join.yaml", ""
    service, deployment = etcd_objects(spec)
    job = pytorchjob(spec)
    notes = {id(deployment): ETCD_NOTE}  # YAML comments: the JSON documents cannot hold one
    if fast_on_nodes(spec):
        notes[id(job)] = secret_note(spec)
    docs = [service, deployment, config_map(spec, toml_text), job]
    text = "".join(f"---\n{notes.get(id(d), '')}{json.dumps(d, indent=2)}\n" for d in docs)
    return text, f"{spec.name}.yaml", secret_command(spec) if fast_on_nodes(spec) else ""


def _earlier(path: Path, first: list[str]) -> bool:
    """True for a launch file written before by this command (its first lines match and
    it names disttrain)."""
    try:
        text = path.read_text(errors="replace")
        return text.split("\n", 2)[:2] == first and "disttrain" in text
    except OSError:
        return False


def main(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    text, default, first_run = render(ns)
    out = ns.output or default
    secret_step = f"create its job secret once: {first_run}" if first_run else ""
    if out == "-":
        sys.stdout.write(text)
        if secret_step:
            print(f"disttrain launch-file: before you apply it, {secret_step}", file=sys.stderr)
        return 0
    first = text.split("\n", 2)[:2]
    path = output_file(out, "-o", replaceable=lambda p: _earlier(p, first))
    try:
        path.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write -o {out}: {e.strerror or e}.") from None
    how = f"sbatch {out}" if ns.kind == "slurm" else f"kubectl apply -f {out}"
    if ns.join:
        how = f"kubectl create -f {out} (each create adds one node to the running job)"
    how = f"{secret_step}; then submit with: {how}" if secret_step else f"submit with: {how}"
    print(f"disttrain launch-file: wrote {out}; {how}", file=sys.stderr)
    return 0
