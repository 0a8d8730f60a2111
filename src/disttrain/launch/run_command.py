"""`disttrain run`: torchrun (`torch.distributed.run`) with safer defaults.

What it changes, and why:
- One node and no rendezvous endpoint given: `--standalone`, whose c10d store binds
  a free port, so two jobs on one host never collide (P-INIT-4).
- `--nproc` (alias of `--nproc-per-node`) defaults to the GPU count, or 2 on CPU.
  More processes than visible GPUs is refused before anything starts (P-INIT-5).
- `OMP_NUM_THREADS` = cores / processes (at least 1) unless the user set it, so
  ranks do not oversubscribe the CPU.
- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` unless set: the agent's shared TCP store
  makes restarted workers fail to connect or hang (pytorch issue 135712).
- A failed worker: one line naming its rank and exit code, which is returned (128 +
  signal for one killed by a signal). What a rank reported through its notes (a user
  error, the program's error: `launch.notes_watch`) is printed instead, without a restart.
- `--hang-timeout S` (default 600, 0 for none): every worker of a plain script runs a
  watchdog (`guard.script_watchdog`); a rank that waits in one collective with no
  progress for S seconds reports the hang, naming the rank that stopped making progress
  and its stack, and the job stops (exit 124). A `dt.Job` script's own watchdog, which
  knows the steps, takes over at `job.wrap`. The watchdogs' side channel is a folder
  this launcher makes private (`guard.private_dir.for_launch`: mkdtemp, 0700), handed
  to the ranks in DISTTRAIN_GUARD_DIR and removed at the end.
- `--debug` sets the verbose switches of P-DEBUG-2 for the backend in use (see
  `debug_env`) and prints them and where the logs go.
- `DISTTRAIN_EXPECTED_WORLD_SIZE` = nnodes x nproc, so a rank can tell that fewer
  processes started than were asked for (`disttrain.guard.sanity.check_world_size`).
- Elastic and multi-node jobs (any rendezvous but `--standalone`) get rendezvous
  settings tuned for fast recovery, merged under the user's `--rdzv-conf`
  (`ELASTIC_RDZV_CONF`), and `--rdzv-backend etcd` means torch's `etcd-v2` backend,
  which survives the loss of any node (the legacy `etcd` one is slower to recover).
- `--shutdown-timeout` = the preemption grace + `SHUTDOWN_MARGIN_S`, so torchrun waits
  for a SIGTERMed worker to save before it sends SIGKILL (torch's default: 30 s). The
  grace is `elastic.preempt_grace_s` for `-m disttrain.train CONFIG`, else
  DISTTRAIN_PREEMPT_GRACE_S, else 60 s; workers get it as DISTTRAIN_PREEMPT_GRACE_S. A
  user's `--shutdown-timeout` (or PET_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) wins.
- A `DISTTRAIN_FAULT` spec with a typo is refused before any worker starts.
- Every worker starts through `disttrain.launch.worker_entry`: a parent-death signal (a
  launcher killed with SIGKILL leaves no orphans), a name that says its rank in `ps`, and
  its pid on stderr at start (runtime/processes.py).
- `--nproc` and `--nnodes` that torchrun cannot use are refused in one line; for `-m
  disttrain.train CONFIG` the checks of `disttrain.launch.preflight` (writable out_dir
  and checkpoint root, a first step that fits in memory) run before any worker starts,
  on the config parsed once here (or by `disttrain train`, which calls `main` with it),
  and the ranks' first attempt takes that config instead of parsing it again
  (`disttrain.train.launcher_findings`: a private file, removed when torchrun returns).
- `-m disttrain.train CONFIG` with `[elastic] fast_recovery = true`, and
  `--fast-recovery script.py` (a `dt.Job` script): each worker slot runs
  `disttrain.launch.slot_supervisor`, which keeps the training process and a warm spare
  as its children (docs/elastic.md); a script runs under `disttrain.train.script_runner`.
- Warm workers (`disttrain.launch.warm_workers`): every start and restart forks the
  Python workers (under fast recovery the training processes and spares) from a process
  that has imported torch and disttrain. `DISTTRAIN_WARM_WORKERS=0` turns it off.
- A fast-recovery job gets a random secret in DISTTRAIN_JOB_SECRET (the environment,
  never the command line), with which its ranks seal what they write to their store
  (`runtime.job_secret`); a multi-node one needs the user's, the same on every node.
  Under `--rdzv-backend etcd` its store is that etcd (FAST_STORE_ENV, `elastic.etcd_store`)
  instead of global rank 0's supervisor, so the loss of node 0 does not take it.
- `--spare-nodes K` (fast recovery, `--nnodes N`, a rendezvous endpoint): torchrun gets
  `--nnodes N+K` and the ranks DISTTRAIN_TRAINING_WORLD = N x nproc; the slots past it
  stand by and take a lost node's places in memory (`elastic.membership`). Under a
  rendezvous other than etcd one line says that its host cannot be lost.
- After a fast-recovery job shrank in memory (a node lost, no spare: the ranks' notes),
  this launcher's torchrun agent waits at torchrun's exit barrier for the nodes left
  only, not its 300 s for the lost one (`torch_compat.exit_barrier_of`), and the last
  line says at which world the job finished; a rank that left fast recovery for
  torchrun's restart path (left out of a shrink) is named in the last line, with
  whether a restart was left.
Every other torchrun flag passes through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disttrain.check.settings import STEPS_FLAG, take_check_flags
from disttrain.errors import UserError
from disttrain.guard import private_dir
from disttrain.guard.script_watchdog import HANG_FLAG, take_hang_timeout
from disttrain.launch import job_end, notes_watch, rendezvous_end, run_help, slot_supervisor, warm_workers
from disttrain.launch.end_lines import (
    restart_path_line,
    shrunk_line,
)
from disttrain.launch.join_flags import JOIN_FLAG, take_join
from disttrain.launch.join_flags import RUN_ENV as JOIN_RUN_ENV
from disttrain.launch.worker_entry import LAUNCHER_ENV
from disttrain.runtime import job_secret

if TYPE_CHECKING:  # the config and the trainer's modules import torch: only when used
    from disttrain.config import Config
    from disttrain.train.launcher_findings import Launched

DEFAULT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

SHUTDOWN_MARGIN_S = 10
"""Seconds torchrun waits past the preemption grace before SIGKILL: a rank's exit
after its save (process group teardown, interpreter shutdown)."""
FAST_STORE_ENV = "DISTTRAIN_FAST_STORE"  # elastic.etcd_store.STORE_ENV; not imported: that imports torch
TRAINING_WORLD_ENV = "DISTTRAIN_TRAINING_WORLD"  # elastic.membership's (the slots that train)
NODE_LEASE_ENV = "DISTTRAIN_NODE_LEASE_S"  # elastic.membership.LEASE_ENV
JOB_OWNED = (
    FAST_STORE_ENV,
    TRAINING_WORLD_ENV,
    NODE_LEASE_ENV,
    "DISTTRAIN_EXPECTED_WORLD_SIZE",  # guard.sanity's: the world this launcher starts
    slot_supervisor.TOTAL_SLOTS_ENV,  # set by each slot supervisor for its children
    slot_supervisor.ROLE_ENV,
)
"""What describes this job to its workers, set by this launcher alone (or by none, where
the job has no such thing): a value an outer job or an earlier one left in this
environment would be wrong (a stale total of slots: standby slots that do not exist),
and a flag's value must win over it (`--elastic.node_lease_s`)."""
DEFAULT_PREEMPT_GRACE_S = 60.0
"""The grace when neither a trainer config nor DISTTRAIN_PREEMPT_GRACE_S names one
(the default of `elastic.preempt_grace_s`)."""
SHUTDOWN_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")
BACKEND_FLAGS = ("--rdzv-backend", "--rdzv_backend")
SHUTDOWN_ENV = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")

# Rendezvous settings for elastic jobs, each with its reason (torch's default in brackets):
ELASTIC_RDZV_CONF = {
    # A rendezvous that cannot complete fails in 2 min instead of hanging [600 s] (P-ELASTIC-5).
    "join_timeout": "120",
    # Once min_nodes are in, wait 2 s for more before starting [30 s]: scale-down 46 s -> ~9 s.
    "last_call_timeout": "2",
    "close_timeout": "10",
    # Heartbeat every second; a node is dead after 5 missed beats [5 s x 3 = 15 s]. Fewer
    # than 3 missed beats let a restarting agent declare a live one dead (split brain).
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "5",
}


def _elastic_flags(flags: list[str]) -> list[str]:
    """Map `etcd` to `etcd-v2` and merge ELASTIC_RDZV_CONF under the user's --rdzv-conf."""
    out, user_conf = [], ""
    i = 0
    while i < len(flags):
        f = flags[i]
        name, eq, value = f.partition("=")
        if name in ("--rdzv-conf", "--rdzv_conf"):
            user_conf = value if eq else flags[i + 1]
            i += 1 if eq else 2
            continue
        if name in ("--rdzv-backend", "--rdzv_backend"):
            backend = value if eq else flags[i + 1]
            out += [name, "etcd-v2" if backend == "etcd" else backend]
            i += 1 if eq else 2
            continue
        out.append(f)
        i += 1
    conf = dict(ELASTIC_RDZV_CONF)
    for key, _, value in (kv.partition("=") for kv in user_conf.split(",") if "=" in kv):
        conf[key] = value
    return out + ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]


def _flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last `--name V` or `--name=V` before the script argument."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split at the first positional (the script or module), so its args pass untouched."""
    flags_with_value = {
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        "--nnodes",
        "--rdzv-backend",
        "--rdzv_backend",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        "--rdzv-id",
        "--rdzv_id",
        "--rdzv-conf",
        "--rdzv_conf",
        "--max-restarts",
        "--max_restarts",
        "--monitor-interval",
        "--monitor_interval",
        "--node-rank",
        "--node_rank",
        "--master-addr",
        "--master_addr",
        "--master-port",
        "--master_port",
        "--local-addr",
        "--local_addr",
        "--log-dir",
        "--log_dir",
        "-r",
        "--redirects",
        "-t",
        "--tee",
        "--start-method",
        "--start_method",
        "--role",
        "--local-ranks-filter",
        "--local_ranks_filter",
        "--logs-specs",
        "--logs_specs",
        "--rdzv-timeout",
        "--event-log-handler",
        "--signals-to-handle",
        "--signals_to_handle",
        HANG_FLAG,
        STEPS_FLAG,
        run_help.SPARE_NODES_FLAG,
        *SHUTDOWN_FLAGS,
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return argv[:i], argv[i:]
        if arg in ("-m", "--module", "--no-python", "--no_python"):
            i += 1
            continue
        i += 2 if arg in flags_with_value else 1
    return argv, []


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
"""The words torchrun takes for --nproc-per-node besides a number."""


def check_counts(nproc: str, nnodes: str | None) -> None:
    """Refuse an --nproc or --nnodes torchrun cannot use (`UserError`, one line)."""
    if not (nproc.isdigit() or nproc in NPROC_WORDS):
        raise UserError(
            f"--nproc is {nproc!r}; give a number of processes per node (or one of "
            f"{', '.join(NPROC_WORDS)}), for example --nproc 2."
        )
    if nnodes is None:
        return
    parts = nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1 or int(parts[-1]) < int(parts[0]):
        raise UserError(
            f"--nnodes is {nnodes!r}; give a number of nodes >= 1, or MIN:MAX with "
            f"1 <= MIN <= MAX for an elastic job, for example --nnodes 2 or --nnodes 1:4."
        )


def visible_gpus() -> int:
    import torch  # device_count: through NVML where it answers; is_available would poison forks

    return torch.cuda.device_count()


def debug_env(backend: str) -> dict[str, str]:
    """The verbose switches of P-DEBUG-2 for `backend` ('nccl' or 'gloo')."""
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    if backend == "nccl":
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,COLL", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    else:  # gloo logs through c10d's C++ logger
        env["TORCH_CPP_LOG_LEVEL"] = "INFO"
    return env


def preempt_grace_s(cfg: Config | None) -> float:
    """Seconds a preempted worker has to save: the trainer config's
    `elastic.preempt_grace_s` (`-m disttrain.train CONFIG`); otherwise
    DISTTRAIN_PREEMPT_GRACE_S, else `DEFAULT_PREEMPT_GRACE_S`. Raises `UserError` for a
    bad value."""
    if cfg is not None:
        return cfg.elastic.preempt_grace_s
    raw = os.environ.get("DISTTRAIN_PREEMPT_GRACE_S", "")
    if not raw:
        return DEFAULT_PREEMPT_GRACE_S
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace > 0:
        raise UserError(
            f"DISTTRAIN_PREEMPT_GRACE_S is {raw!r}; set it to the positive number of "
            f"seconds a preempted worker has to save."
        )
    return grace


NOT_PYTHON_FLAGS = ("--no-python", "--no_python", "--run-path", "--run_path")
"""torchrun flags under which a worker is not `python -m MODULE` (no worker_entry, no
warm server)."""


def warm_workers_wanted(flags: list[str], script: list[str]) -> bool:
    """Whether torchrun's workers for FLAGS SCRIPT (as `torchrun_for` has made
    them, a slot supervisor already in front for fast recovery) fork from a warm server:
    any Python worker but a slot supervisor (it forks its training process and spare
    from the server itself), and
    DISTTRAIN_WARM_WORKERS not 0. Raises `UserError` for a switch other than 0 or 1."""
    switch = os.environ.get(warm_workers.SWITCH_ENV, "1")
    if switch not in ("0", "1"):
        raise UserError(
            f"{warm_workers.SWITCH_ENV} is {switch!r}; set it to 1 (fork workers from "
            f"a process with torch imported, the default) or 0 (fresh interpreters)."
        )
    return (
        switch == "1"
        and script[:1] != ["disttrain.launch.slot_supervisor"]
        and not any(f in flags for f in NOT_PYTHON_FLAGS)
    )


def trainer_config(script: list[str], is_module: bool, cfg: Config | None, world: int | None) -> Config | None:
    """The config of `-m disttrain.train CONFIG [overrides]` (None for any other script):
    `cfg` where the caller has loaded and checked it (`disttrain train`), else loaded
    here and checked by `preflight` for `world` ranks. Raises `UserError`."""
    if not (is_module and len(script) > 1 and script[0] == "disttrain.train"):
        return None
    if cfg is None:
        from disttrain.config import load_config
        from disttrain.launch.preflight import preflight

        cfg = load_config(script[1], script[2:])
        preflight(cfg, world=world)
    return cfg


@dataclass
class Torchrun:
    """What `torchrun_for` makes of `disttrain run`'s arguments: torchrun's `args`, the
    environment defaults `env`, and the trainer's config `cfg` (None for a script)."""

    args: list[str]
    env: dict[str, str]
    cfg: Config | None


def torchrun_for(argv: list[str], cfg: Config | None = None) -> Torchrun:
    """Translate `disttrain run` arguments into torchrun arguments plus env defaults.
    `cfg`: the config of `-m disttrain.train CONFIG`, loaded and checked by the caller
    (else `trainer_config` loads and checks it here).

    Raises `UserError` for a missing script, more processes than visible GPUs, a bad
    config or a bad preemption grace (see `preempt_grace_s`).
    """
    flags, script = split_script(argv)
    debug, fast = "--debug" in flags, "--fast-recovery" in flags
    flags = [f for f in flags if f not in ("--debug", "--fast-recovery")]
    flags, hang_env = take_hang_timeout(flags, _flag_value(flags, HANG_FLAG))
    flags, check_env = take_check_flags(flags)  # --check: the ranks install disttrain.check
    spare_nodes = _flag_value(flags, run_help.SPARE_NODES_FLAG)
    flags = _without(flags, run_help.SPARE_NODES_FLAG)
    rdzv = (
        _flag_value(flags, "--rdzv-backend", "--rdzv_backend"),
        _flag_value(flags, "--rdzv-endpoint", "--rdzv_endpoint"),
        _flag_value(flags, "--rdzv-id", "--rdzv_id"),
    )
    flags, join_env = take_join(flags, spare_nodes, rdzv)  # a node that joins a running job: standalone
    if not script:
        raise UserError(f"no script given. {run_help.USAGE}; disttrain run --help lists the flags.")
    flags = [
        "--nproc-per-node"
        if f == "--nproc"
        else f.replace("--nproc=", "--nproc-per-node=", 1)
        if f.startswith("--nproc=")
        else f
        for f in flags
    ]
    gpus = visible_gpus()
    nproc = _flag_value(flags, "--nproc-per-node", "--nproc_per_node")
    if nproc is None:
        nproc = str(gpus or 2)
        flags = ["--nproc-per-node", nproc] + flags
    check_counts(nproc, _flag_value(flags, "--nnodes"))
    if nproc.isdigit():
        if int(nproc) < 1:
            raise UserError(f"--nproc is {nproc}; start at least one process.")
        if gpus and int(nproc) > gpus:
            raise UserError(
                f"--nproc {nproc} asks for more processes than the {gpus} visible GPU(s); "
                f"each process needs its own GPU (P-INIT-5). Use --nproc {gpus} or "
                f"widen CUDA_VISIBLE_DEVICES."
            )
    nnodes = _flag_value(flags, "--nnodes") or "1"
    endpoint = _flag_value(flags, "--rdzv-endpoint", "--rdzv_endpoint")
    spares = check_spare_nodes(spare_nodes, nnodes, endpoint)
    if spares:  # torchrun starts the spare nodes too; the ranks are told which slots train
        flags = _without(flags, "--nnodes") + ["--nnodes", str(int(nnodes) + spares)]
        if _flag_value(flags, "--rdzv-backend", "--rdzv_backend") not in ("etcd", "etcd-v2"):
            print(
                "disttrain run: under this rendezvous the node that hosts it cannot be lost (its loss ends "
                "the job); --rdzv-backend etcd lets a spare take the place of any node.",
                file=sys.stderr,
            )
    if nnodes in ("1", "1:1") and endpoint is None and "--standalone" not in flags:
        flags = ["--standalone"] + flags
    elif "--standalone" not in flags:
        flags = _elastic_flags(flags)
    env = dict(DEFAULT_ENV, **hang_env, **check_env, **join_env)
    if debug:
        env.update(debug_env("nccl" if gpus else "gloo"))
    if nproc.isdigit() and nnodes.isdigit():
        env["DISTTRAIN_EXPECTED_WORLD_SIZE"] = str(int(nproc) * int(nnodes))
        if spares:
            env[TRAINING_WORLD_ENV] = env["DISTTRAIN_EXPECTED_WORLD_SIZE"]
    if nproc.isdigit():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(nproc)))
    is_module = any(f in flags for f in ("-m", "--module", "--no-python", "--no_python"))
    if not is_module and not os.path.isfile(script[0]):
        raise UserError(f"script {script[0]!r} not found. Pass the path of a Python file (or -m package.module).")
    nodes = nnodes.split(":")[-1]
    cfg = trainer_config(
        script, is_module, cfg, world=int(nproc) * int(nodes) if nproc.isdigit() and nodes.isdigit() else None
    )
    grace = preempt_grace_s(cfg)
    if cfg is not None and cfg.elastic.fast_recovery:
        script = ["disttrain.launch.slot_supervisor", *script]
    if fast and not (script[:1] == ["disttrain.train"] and is_module):
        if is_module or not script[0].endswith(".py"):
            raise UserError(
                "--fast-recovery runs a Python script that uses dt.Job (disttrain run "
                "--fast-recovery --nproc N script.py); for disttrain train set "
                "[elastic] fast_recovery = true in the config."
            )
        # each worker slot: a supervisor with the training process and a warm spare
        script = ["disttrain.launch.slot_supervisor", "disttrain.train.script_runner", *script]
        flags, is_module = flags + ["-m"], True
    if (spares or join_env) and script[:1] != ["disttrain.launch.slot_supervisor"]:
        raise UserError(
            f"{run_help.SPARE_NODES_FLAG if spares else JOIN_FLAG} needs fast recovery (the state is handed over "
            f"in memory): set [elastic] fast_recovery = true in the config (-m disttrain.train, disttrain "
            f"train), or pass --fast-recovery for a dt.Job script."
        )
    if cfg is not None and script[:1] == ["disttrain.launch.slot_supervisor"]:
        env[NODE_LEASE_ENV] = f"{cfg.elastic.node_lease_s:g}"
    if script[:1] == ["disttrain.launch.slot_supervisor"]:
        # the store's values carry it; a joining node needs the job's
        secret = job_secret.for_job("join" if join_env else str(int(nnodes) + spares) if spares else nnodes)
        if secret is not None:
            env[job_secret.SECRET_ENV] = secret
        if _flag_value(flags, "--rdzv-backend", "--rdzv_backend") == "etcd-v2" and endpoint:
            # the generations agree on the etcd, which no node of the job hosts
            env[FAST_STORE_ENV] = "etcd://" + endpoint.split(",")[0].removeprefix("http://")
    warm = warm_workers_wanted(flags, script)
    if warm and not (is_module and script[0].startswith("disttrain.")):
        # a user's script or module: the forked child starts it through worker_entry
        # (its hang watchdog belongs in the child, not in the stub)
        script = ["disttrain.launch.worker_entry", *(["-m"] if is_module else []), *script]
        flags, is_module = (flags if is_module else flags + ["-m"]), True
    if warm:
        script = ["disttrain.launch.warm_workers", *script]
    if not any(f in flags for f in NOT_PYTHON_FLAGS):
        # every worker gets a parent-death signal (launch/worker_entry.py)
        script = ["disttrain.launch.worker_entry", *(["-m"] if is_module else []), *script]
        flags = flags if is_module else flags + ["-m"]
    env["DISTTRAIN_PREEMPT_GRACE_S"] = f"{grace:g}"
    if (
        _flag_value(flags, *SHUTDOWN_FLAGS) is None
        and not any(os.environ.get(k) for k in SHUTDOWN_ENV)
        and torchrun_has_shutdown_timeout()
    ):
        flags = flags + ["--shutdown-timeout", str(math.ceil(grace) + SHUTDOWN_MARGIN_S)]
    return Torchrun(flags + script, env, cfg)


def _without(flags: list[str], name: str) -> list[str]:
    """`flags` less every `name V` and `name=V`."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
        elif f == name and i + 1 < len(flags):
            skip = True
        elif not f.startswith(name + "="):
            out.append(f)
    return out


def check_spare_nodes(value: str | None, nnodes: str, endpoint: str | None) -> int:
    """The hot-spare node count of `--spare-nodes` (0 when not given). Raises `UserError`
    for a count that is not a whole number, an elastic `--nnodes MIN:MAX` (spares replace
    lost nodes of a fixed world), or no rendezvous endpoint (the spares are other nodes)."""
    if value is None:
        return 0
    flag = run_help.SPARE_NODES_FLAG
    if not value.isdigit():
        raise UserError(f"{flag} is {value!r}; give the number of standby nodes, for example {flag} 1.")
    if not nnodes.isdigit():
        raise UserError(
            f"{flag} takes the place of a lost node in a fixed world, and --nnodes is {nnodes!r}; give "
            f"--nnodes N (the nodes that train) and {flag} K (the nodes that stand by)."
        )
    if int(value) and endpoint is None:
        raise UserError(
            f"{flag} {value} starts more than one node: give --rdzv-backend etcd --rdzv-endpoint HOST:PORT "
            f"(under etcd any node can be lost, node 0 included), the same on every node."
        )
    return int(value)


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes `--shutdown-timeout` (2.11 does not: it then
    keeps its fixed 30 s wait, and a longer preemption grace is cut short there)."""
    from disttrain.runtime.torch_compat import torchrun_flags  # imports torch: only when asked

    return "--shutdown-timeout" in torchrun_flags()


def main(argv: list[str], launched: Launched | None = None) -> int:
    """Run torchrun in this process and return the job's exit code.

    `launched`: what `disttrain train` found (the validated config, preflight passed,
    and the resume inspection). For `-m disttrain.train CONFIG` without it the config
    is loaded and checked here, once. Either way it is handed to the ranks for their
    first attempt (`train.launched`: a private file, removed when torchrun returns)."""
    if any(f in ("-h", "--help") for f in split_script(argv)[0]):
        return run_help.show()
    from disttrain.runtime.fault_injection import parse as parse_faults

    parse_faults(os.environ.get("DISTTRAIN_FAULT", ""))  # a typo fails here, not in every rank
    run = torchrun_for(argv, launched.cfg if launched else None)  # a user's mistake is refused first
    if JOIN_RUN_ENV in run.env:  # a joining node: the job is found here, or one line says why not
        from disttrain.elastic import join_node

        join_node.find_job(run.env[JOIN_RUN_ENV], run.env[FAST_STORE_ENV].removeprefix("etcd://"))
    from disttrain.train.launcher_findings import Launched, handed

    if launched is None and run.cfg is not None:
        launched = Launched(tuple(split_script(argv)[1][1:]), run.cfg)
    args = run.args
    slots = "disttrain.launch.slot_supervisor" in args and os.environ.get(warm_workers.SWITCH_ENV, "1") == "1"
    # The ranks' hang-watchdog folder: private to this user and this job, made
    # before the warm server so that its forks inherit it too.
    with private_dir.for_launch():
        server = warm_workers.start_server() if "disttrain.launch.warm_workers" in args or slots else None
        try:
            if server:
                os.environ[warm_workers.SOCKET_ENV] = server[1]
            with handed(launched):
                return _launch(args, run.env)
        finally:
            if server:
                warm_workers.stop_server(server)
                os.environ.pop(warm_workers.SOCKET_ENV, None)


def _launch(args: list[str], env: dict[str, str]) -> int:
    """torchrun with `torchrun_for`'s arguments and environment defaults;
    failures reported in one line (see `main`)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from disttrain.elastic import note_relay

    _set_launch_env(args, env)
    notes = notes_watch.watch()
    made_secret = env.get(job_secret.SECRET_ENV)
    if made_secret:  # this job's own, never one an earlier job left in this process
        os.environ[job_secret.SECRET_ENV] = made_secret
    lost_peer = lambda: bool(notes.lost_peer_ranks()) and not notes.stopped()  # noqa: E731
    rendezvous = rendezvous_end.Seen(
        _flag_value(args, *BACKEND_FLAGS),
        _flag_value(args, "--rdzv-endpoint", "--rdzv_endpoint"),
        _flag_value(args, "--rdzv-id", "--rdzv_id") or "none",
        _flag_value(args, "--nnodes"),
    )
    if rendezvous.nnodes not in (None, "1", "1:1"):  # other nodes get a stop's note too
        notes.on_stop = lambda: note_relay.publish(rendezvous.where(), notes.stop_note())
        notes.ask_others(lambda: rendezvous.rounds and note_relay.adopt(rendezvous.where(), notes.folder))
        os.environ[note_relay.RELAY_ENV] = note_relay.for_workers(rendezvous.where())
    try:
        with rendezvous_end.captured(rendezvous, lost_peer):
            _torchrun(args, notes, rendezvous)
    except ChildFailedError as e:
        if rendezvous.closed_by_another and note_relay.adopt(rendezvous.where(), notes.folder):
            return notes.report()
        return job_end.child_failed(e, notes, rendezvous.closed_by_another)
    except SignalException as e:
        if notes.stopped():  # a rank's note: the other nodes end at their next rendezvous, not its timeout
            rendezvous_end.close(rendezvous.handlers)
            return notes.report()
        return job_end.signalled(int(e.sigval), notes)
    except RendezvousError as e:  # the rendezvous closed, gone, or not filled: one line, no traceback
        if notes.stopped() or (rendezvous.rounds and note_relay.adopt(rendezvous.where(), notes.folder)):
            return notes.report()
        return job_end.rendezvous_failed(e, notes, rendezvous)
    else:
        if notes.stopped():  # a rank of another node stopped the job; this node's ranks ended quietly
            rendezvous_end.close(rendezvous.handlers)
            return notes.report()
    finally:
        shrunk, left = notes.shrunk(), notes.restart_path()
        notes.close()
        os.environ.pop(note_relay.RELAY_ENV, None)
        if made_secret:
            os.environ.pop(job_secret.SECRET_ENV, None)
    if shrunk or left:
        print(f"disttrain run: {restart_path_line(left) if left else shrunk_line(shrunk or {})}", file=sys.stderr)
    return 0


def _set_launch_env(args: list[str], env: dict[str, str]) -> None:
    """The launcher's environment for torchrun and its workers: `env` under what the user
    set, except the variables that describe this job (`JOB_OWNED`), always its own."""
    for key in JOB_OWNED:
        os.environ.pop(key, None)
    for key, value in env.items():
        if key in JOB_OWNED:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # this job's own launcher, never an outer one
    if "TORCH_DISTRIBUTED_DEBUG" in env:  # --debug: say what was switched on and where it goes
        log_dir = _flag_value(args, "--log-dir", "--log_dir")
        where = (
            f"per-rank files under {log_dir}"
            if log_dir
            else "this terminal (every rank's stdout and stderr, interleaved); add "
            "--log-dir DIR --tee 3 for one file per rank"
        )
        switches = " ".join(
            f"{k}={os.environ[k]}" for k in sorted(env) if k.startswith(("TORCH_", "NCCL_")) and k not in DEFAULT_ENV
        )
        print(f"disttrain run --debug: {switches}. Logs: {where}.", file=sys.stderr, flush=True)


def _torchrun(args: list[str], notes: notes_watch.Notes, rendezvous: rendezvous_end.Seen) -> None:
    """torchrun's `run` in this process, with disttrain's hooks on its agent."""
    from torch.distributed.run import parse_args, run

    from disttrain.runtime.torch_compat import (
        exit_barrier_of,
        quick_rendezvous_event_names,
        waiting_nodes_through_outages,
    )

    quick_rendezvous_event_names()  # torchrun's event names without inspect.stack()
    endpoint = rendezvous.endpoint
    # after a shrink in memory the exit barrier waits for the nodes left, not the lost one
    with exit_barrier_of(notes.agents_gone), contextlib.ExitStack() as outages:
        # etcd outlives every node and may restart under a job; c10d's store dies with its node
        if endpoint is not None and rendezvous.backend == "etcd-v2":
            outages.enter_context(waiting_nodes_through_outages(functools.partial(job_end.say_outage, endpoint)))
        run(parse_args(args))
