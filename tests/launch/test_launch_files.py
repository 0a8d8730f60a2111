"""`disttrain launch-file`: the sbatch script passes `bash -n` and shellcheck and runs to
completion on a one-node Slurm the test starts (Debian's slurm-wlm, auth/none, its own
ports and directories); the Kubernetes objects validate against the schemas shipped by
`kubernetes-validate` (strict) and the PyTorchJob against the training operator's
schema (tests/data/kubeflow, see SOURCE.md there), and a wrong manifest fails them."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import ROOT, worker_env

from disttrain import cli
from disttrain.launch.etcd_server import free_port
from disttrain.runtime import job_secret

K8S_VERSION = "1.30"
SCHEMA = ROOT / "tests" / "data" / "kubeflow" / "pytorchjob_v1.schema.json"
TINY = """[model]
block_size = 32
n_layer = 1
n_head = 2
n_embd = 32
[data]
max_bytes = 24577
[parallel]
nproc = 1
[train]
steps = 3
batch_size = 4
eval_every = 0
log_every = 1
out_dir = "{out}"
"""
FAST = "[elastic]\nfast_recovery = true\n"
SECRET_VALUE = re.compile(r"[0-9a-f]{32}")  # 16 random bytes or more, hex: a secret's value


def _cli(capsys, *args: str) -> tuple[int, str]:
    """`disttrain ARGS` in this process (no torch is imported): (exit code, stderr)."""
    rc = cli.main(list(args))
    return rc, capsys.readouterr().err


def _write(tmp: Path, capsys, kind: str, *flags: str, fast: bool = False) -> str:
    """The launch file for tiny_job.toml (job.KIND), or with `fast` for fast_job.toml, which
    turns fast recovery on (fast.KIND)."""
    stem = "fast" if fast else "job"
    cfg = tmp / f"{'fast' if fast else 'tiny'}_job.toml"
    if not cfg.exists():
        cfg.write_text(TINY.format(out=tmp / "out") + (FAST if fast else ""))
    out = tmp / f"{stem}.{kind}"
    rc, err = _cli(capsys, "launch-file", kind, str(cfg), "-o", str(out), *flags)
    assert rc == 0, err
    return out.read_text()


# --- Slurm ------------------------------------------------------------------------------

def test_sbatch_passes_bash_n_and_shellcheck(tmp_path, capsys):
    text = _write(tmp_path, capsys, "slurm", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                  "--time", "1-00:00:00", "--max-restarts", "5")
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@100",
                 'scontrol requeue "$SLURM_JOB_ID"', 'scancel --signal=TERM "$SLURM_JOB_ID"',
                 "--max-restarts 5 -m disttrain.train",
                 'srun --ntasks-per-node=1 --kill-on-bad-exit=1 disttrain check --nnodes 4 "',
                 'disttrain run --nnodes 4 "'):
        assert line in text, line
    assert "DISTTRAIN_JOB_SECRET" not in text and "--no-kill" not in text  # no fast recovery: not needed
    _write(tmp_path, capsys, "slurm", "--nodes", "3", "--spare-nodes", "1", fast=True)  # linted too
    scripts = [str(tmp_path / "job.slurm"), str(tmp_path / "fast.slurm")]
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True, timeout=30)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/test.sh installs it)")
    lint = subprocess.run(["shellcheck", "--severity=info", *scripts], capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout


def _stubs(folder: Path, **scripts: str) -> dict[str, str]:
    """Executables NAME=BODY (bash) in `folder`; the environment that finds them first,
    without a job secret of the test's own."""
    folder.mkdir()
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/bash\n{body}\n")
        (folder / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != job_secret.SECRET_ENV}
    return dict(env, PATH=f"{folder}{os.pathsep}{env['PATH']}")


def test_sbatch_with_spares_starts_n_plus_k_nodes_with_one_fresh_secret_each_start(tmp_path, capsys):
    """The script as written, with srun and scontrol stubbed (no Slurm here): the check covers
    all N+K nodes, each run gets --nnodes N --spare-nodes K, and both steps get the same job
    secret in their environment, never on their command line; the next start makes another."""
    text = _write(tmp_path, capsys, "slurm", "--nodes", "3", "--spare-nodes", "1", fast=True)
    assert "#SBATCH --nodes=4" in text and "#SBATCH --no-kill" in text and not SECRET_VALUE.search(text)
    log = tmp_path / "srun.log"
    env = _stubs(tmp_path / "bin", srun=f'printf "%s|%s\\n" "$*" "${{{job_secret.SECRET_ENV}:-}}" >> {log}',
                 scontrol='echo node1', scancel="true")
    env.update(SLURM_JOB_NODELIST="node[1-4]", SLURM_JOB_ID="7")
    starts = []
    for _ in range(2):  # a requeued job runs the script again
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(tmp_path / "fast.slurm")], env=env, check=True, timeout=30)
        (check, check_secret), (run, run_secret) = (line.split("|") for line in log.read_text().splitlines())
        assert "disttrain check --nnodes 4 --nproc-per-node 1" in check and "--spare-nodes" not in check
        assert "--no-kill disttrain run --nnodes 3 --spare-nodes 1 --nproc-per-node 1" in run
        assert check_secret == run_secret and check_secret not in check + run
        job_secret.from_env({job_secret.SECRET_ENV: run_secret})  # 16 bytes or more, hex
        starts.append(run_secret)
    assert starts[0] != starts[1]


def _slurm_conf(root: Path) -> Path:
    host = socket.gethostname().split(".")[0]
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=disttrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _wait(predicate, seconds: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in logs if p.exists())
    pytest.fail(f"timed out waiting for {what}\n{tails}")


@pytest.mark.timeout(150)
def test_sbatch_runs_on_a_one_node_slurm(tmp_path, capsys):
    """The generated script as written: its `disttrain check` step and the training."""
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None or os.geteuid() != 0:
        pytest.skip("a one-node Slurm needs Debian's slurm-wlm and root (scripts/test.sh installs it)")
    root = tmp_path / "slurm"
    root.mkdir()
    conf = _slurm_conf(root)
    env = worker_env(SLURM_CONF=str(conf), PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    logs = [root / "slurmctld.log", root / "slurmd.log"]
    daemons = [subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
               for daemon, log in zip(("slurmctld", "slurmd"), logs, strict=False)]

    def sh(*cmd: str) -> str:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path).stdout

    try:
        _wait(lambda: "idle" in sh("sinfo", "-h", "-o", "%T"), 30, "the Slurm node to come up", logs)
        _write(tmp_path, capsys, "slurm", "--nodes", "1", "--time", "10", "--name", "tiny")
        job = sh("sbatch", "--parsable", str(tmp_path / "job.slurm")).strip().split(";")[0]
        assert job.isdigit(), f"sbatch said {job!r}"

        def finished() -> str:
            state = sh("scontrol", "show", "job", job)
            return state if any(f"JobState={s}" in state for s in ("COMPLETED", "FAILED", "CANCELLED",
                                                                      "TIMEOUT", "NODE_FAIL")) else ""
        state = _wait(finished, 120, f"Slurm job {job}", logs + [tmp_path / f"tiny-{job}.out"])
        output = (tmp_path / f"tiny-{job}.out").read_text()
        assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + output
        assert "1 node(s) healthy" in output  # the check step ran before the training
        steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").open()]
        assert steps[-1] == 3 and (tmp_path / "out" / "model.pt").exists()
    finally:
        for d in daemons:
            os.killpg(d.pid, 9)
            d.wait(timeout=10)


# --- Kubernetes ---------------------------------------------------------------------------

def _k8s(tmp: Path, capsys, *flags: str) -> list[dict]:
    text = _write(tmp, capsys, "k8s", "--nodes", "4", "--min-nodes", "2", "--gpus-per-node", "8",
                  "--image", "registry.example/train:1", "--pvc", "shared-data", *flags)
    return [d for d in yaml.safe_load_all(text) if d]


def _pytorchjob_validator():
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    defs = schema_contents(f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json",
                           K8S_VERSION)
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()), registry=registry)


def test_k8s_manifest_validates_against_the_schemas(tmp_path, capsys):
    import kubernetes_validate

    docs = _k8s(tmp_path, capsys)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service", "Deployment", "ConfigMap", "PyTorchJob"]
    for doc in docs[:3]:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    job = docs[3]
    _pytorchjob_validator().validate(job)
    # The parts must also fit together: the workers' endpoint is the etcd Service,
    # which selects the etcd pods; the elastic range is the one asked for.
    service, deployment = docs[0], docs[1]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert "--enable-v2=true" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["nProcPerNode"]) == (2, 4, 8)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert pod["containers"][0]["name"] == "pytorch"  # the operator finds its container by name
    i = command.index("--rdzv-endpoint")
    assert command[i + 1] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert command[command.index("--nnodes") + 1] == "2:4" and worker["replicas"] == 4
    assert pod["terminationGracePeriodSeconds"] > 60  # the default grace of 60 s fits in it
    assert "env" not in pod["containers"][0]  # no fast recovery: no job secret to share
    assert docs[2]["data"]["config.toml"] == (tmp_path / "tiny_job.toml").read_text()


def test_k8s_etcd_listens_on_its_pods_address_and_says_how_to_require_certificates(tmp_path, capsys):
    text = _write(tmp_path, capsys, "k8s", "--nodes", "2", "--image", "registry.example/train:1")
    etcd = [d for d in yaml.safe_load_all(text) if d][1]["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in etcd["command"][1:])
    assert flags["--listen-client-urls"] == "http://$(POD_IP):2379"  # not 0.0.0.0: the pod's own address
    assert flags["--listen-peer-urls"].startswith("http://127.0.0.1:")
    assert etcd["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    head, _, rest = text.partition('"kind": "Deployment"')  # the note sits right above the etcd Deployment
    note = head.rsplit("---", 1)[1]
    assert "no authentication and no TLS" in note and "docs/security.md" in note and "--client-cert-auth" in note


def test_k8s_spares_run_a_fixed_world_with_the_job_secret_from_a_secret(tmp_path, capsys):
    """--spare-nodes K: N+K replicas of `disttrain run --nnodes N --spare-nodes K`, each
    taking DISTTRAIN_JOB_SECRET from a Secret the file names but does not hold; the command
    the file and the message give creates that Secret with a random value (kubectl stubbed)."""
    text = _write(tmp_path, capsys, "k8s", "--nodes", "3", "--spare-nodes", "1", "--image", "registry.example/t:1",
                  "--namespace", "team-a", fast=True)
    job = [d for d in yaml.safe_load_all(text) if d][3]
    _pytorchjob_validator().validate(job)
    policy, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert (policy["minReplicas"], policy["maxReplicas"], worker["replicas"]) == (4, 4, 4)
    container = worker["template"]["spec"]["containers"][0]
    i = container["command"].index("--nnodes")
    assert container["command"][i:i + 4] == ["--nnodes", "3", "--spare-nodes", "1"]
    ref = {"secretKeyRef": {"name": "fast-job-job-secret", "key": "secret"}}
    assert container["env"] == [{"name": job_secret.SECRET_ENV, "valueFrom": ref}]
    assert not SECRET_VALUE.search(text)
    command = text.split("\n#   ", 1)[1].split("\n", 1)[0]  # the note above the PyTorchJob
    rc, err = _cli(capsys, "launch-file", "k8s", str(tmp_path / "fast_job.toml"), "--nodes", "2", "--min-nodes",
                   "1", "--image", "x", "--namespace", "team-a", "-o", str(tmp_path / "elastic.yaml"))
    assert rc == 0 and f"create its job secret once: {command}; then submit with: kubectl apply" in err, err
    elastic = [d for d in yaml.safe_load_all((tmp_path / "elastic.yaml").read_text()) if d][3]
    pod = elastic["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["env"] == container["env"]  # fast recovery on 1..2 nodes: the secret too
    kubectl = (f'printf "%s\\n" "$@" > {tmp_path}/args\n'  # reads the file --from-file=KEY=PATH names, as kubectl
               f'for a; do case $a in --from-file=*) f=${{a#*=}}; cat "${{f#*=}}" > {tmp_path}/value;; esac; done')
    subprocess.run(["bash", "-c", command], env=_stubs(tmp_path / "bin", kubectl=kubectl), check=True, timeout=30)
    args, value = (tmp_path / "args").read_text().split(), (tmp_path / "value").read_text()
    assert args == ["create", "secret", "generic", "fast-job-job-secret", "--namespace", "team-a",
                    "--from-file=secret=/dev/stdin"]
    job_secret.from_env({job_secret.SECRET_ENV: value})  # what the pods get: 16 bytes or more, hex


def test_k8s_join_is_one_job_of_the_workers_pod_whose_run_joins_the_job(tmp_path, capsys, monkeypatch):
    """--join: only a Job, whose pod is the PyTorchJob worker's (image, mounts, resources,
    the Secret's job secret) running the worker's command plus --join (less --spare-nodes,
    which a joining node's run refuses); `disttrain run` makes of that command a standalone
    torchrun pointed at the job's run id and etcd."""
    import kubernetes_validate

    from disttrain.config import load_config
    from disttrain.launch import join_flags
    from disttrain.launch.run_command import torchrun_for

    flags = ("--nodes", "3", "--spare-nodes", "1", "--gpus-per-node", "8", "--image", "registry.example/t:1",
             "--pvc", "claim", "--namespace", "team-a")
    pytorchjob = [d for d in yaml.safe_load_all(_write(tmp_path, capsys, "k8s", *flags, fast=True)) if d][3]
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # written again, its own earlier file is replaced
        rc, err = _cli(capsys, "launch-file", "k8s", "fast_job.toml", *flags, "--join")
        assert rc == 0 and "kubectl create -f fast-job-join.yaml (each create adds one node" in err, err
    text = (tmp_path / "fast-job-join.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["Job"]  # no etcd, ConfigMap, Secret or PyTorchJob again
    kubernetes_validate.validate(docs[0], K8S_VERSION, strict=True)
    assert "each `kubectl create -f` of this file adds one more node" in text.lower()
    assert docs[0]["metadata"]["generateName"] == "fast-job-join-" and docs[0]["metadata"]["namespace"] == "team-a"
    pod, worker = docs[0]["spec"]["template"], pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    command, job_command = pod["spec"]["containers"][0].pop("command"), worker["spec"]["containers"][0].pop("command")
    i = job_command.index("--spare-nodes")
    assert command == [*job_command[:2], "--join", *job_command[2:i], *job_command[i + 2:]]
    assert pod["spec"].pop("restartPolicy") == "Never" and pod == worker  # the rest of the pod is the worker's
    ref = {"secretKeyRef": {"name": "fast-job-job-secret", "key": "secret"}}
    assert pod["spec"]["containers"][0]["env"] == [{"name": job_secret.SECRET_ENV, "valueFrom": ref}]
    monkeypatch.setenv(job_secret.SECRET_ENV, "ab" * 32)  # what the Secret gives the pod
    run = torchrun_for(command[2:], load_config(tmp_path / "fast_job.toml"))
    assert "--standalone" in run.args and not {"--nnodes", "--rdzv-id", "--rdzv-endpoint"} & set(run.args)
    assert run.env[join_flags.RUN_ENV] == "fast-job"
    assert run.env[join_flags.FAST_STORE_ENV] == "etcd://fast-job-etcd:2379"


@pytest.mark.parametrize("breakage", ["unknown elastic field", "replicas as text", "bad pod field"])
def test_a_broken_pytorchjob_fails_the_schema(tmp_path, capsys, breakage):
    job = _k8s(tmp_path, capsys)[3]
    if breakage == "unknown elastic field":
        job["spec"]["elasticPolicy"]["minNodes"] = 2
    elif breakage == "replicas as text":
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "4"
    else:
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["cmd"] = ["x"]
    with pytest.raises(jsonschema.ValidationError):
        _pytorchjob_validator().validate(job)


# --- mistakes: one line each, exit 2 ------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["k8s", "--nodes", "2"], "k8s needs --image IMAGE"),
    (["slurm", "--nodes", "2", "--time", "4 hours"], "is not a Slurm time"),
    (["slurm", "--nodes", "0"], "--nodes is 0"),
    (["slurm", "--nodes", "4", "--min-nodes", "2"], "--min-nodes is for k8s"),
    (["k8s", "--nodes", "2", "--image", "x", "--name", "Big_Name"], "is not a Kubernetes name"),
    (["slurm", "--nodes", "2", "--spare-nodes", "1"], "set [elastic] fast_recovery = true in"),
    (["slurm", "--nodes", "2", "--spare-nodes", "-1"], "--spare-nodes is -1"),
    (["k8s", "--nodes", "4", "--min-nodes", "2", "--spare-nodes", "1", "--image", "x"], "drop --min-nodes"),
    (["k8s", "--nodes", "2", "--image", "x", "--join"], "--join needs fast recovery"),
])
def test_launch_file_mistakes_are_one_line(tmp_path, capsys, flags, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out"))
    rc, err = _cli(capsys, "launch-file", flags[0], str(cfg), *flags[1:], "-o", str(tmp_path / "x"))
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags, message", [
    (["slurm", "--nodes", "2"], "--join is for k8s: the sbatch file's c10d rendezvous lives on the job's first node"),
    (["k8s", "--nodes", "4", "--min-nodes", "2", "--image", "x"], "drop --min-nodes"),
    (["k8s", "--nodes", "1", "--image", "x"], "a one-node job's launcher makes its own"),
])
def test_join_refuses_what_no_node_could_join_in_one_line(tmp_path, capsys, flags, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out") + FAST)
    rc, err = _cli(capsys, "launch-file", flags[0], str(cfg), *flags[1:], "--join", "-o", str(tmp_path / "x"))
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_launch_file_names_a_bad_config_key(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nstepz = 3\n")
    rc, err = _cli(capsys, "launch-file", "slurm", str(cfg), "--nodes", "2")
    assert rc == 2 and "stepz" in err and len(err.strip().splitlines()) == 1, err


def test_k8s_refuses_a_relative_path_that_would_land_in_the_config_mount(tmp_path, capsys):
    """In the pod the TOML is /etc/disttrain/config.toml and a relative path in it is taken
    from that read-only folder: one line at launch-file time, not a failed pod."""
    cfg = tmp_path / "c.toml"
    flags = ("--nodes", "2", "--image", "x", "-o", str(tmp_path / "job.yaml"))
    cfg.write_text(TINY.format(out="runs/x"))
    rc, err = _cli(capsys, "launch-file", "k8s", str(cfg), *flags)
    assert rc == 2 and "train.out_dir = 'runs/x'" in err and "/etc/disttrain" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "job.yaml").exists()
    assert _cli(capsys, "launch-file", "k8s", str(cfg), *flags, "--pvc", "claim")[0] == 0  # out_dir on the claim
    cfg.write_text(TINY.format(out="/shared/out") + '[checkpoint]\ndir = "ck"\n')
    rc, err = _cli(capsys, "launch-file", "k8s", str(cfg), *flags[:-1], str(tmp_path / "b.yaml"), "--pvc", "claim")
    assert rc == 2 and "checkpoint.dir = 'ck'" in err, err
