"""`disttrain run --help`: disttrain's own flags, then every torchrun flag, which passes
through unchanged (read from torchrun's own parser, so the list cannot drift)."""

from __future__ import annotations

from disttrain.check.settings import DEFAULT_STEPS, STEPS_FLAG
from disttrain.guard.script_watchdog import HANG_FLAG

SPARE_NODES_FLAG = "--spare-nodes"
USAGE = "usage: disttrain run [disttrain flags] [torchrun flags] (script.py | -m module) [args]"
OWN_FLAGS = (
    ("--nproc N", "processes per node (alias of --nproc-per-node); default: the GPU count, or 2 on CPU"),
    ("--fast-recovery", "a dt.Job script: a warm spare per slot and in-memory recovery (docs/elastic.md)"),
    (
        f"{SPARE_NODES_FLAG} K",
        "under fast recovery: K more nodes stand by, warm; one takes a lost node's ranks in memory",
    ),
    (
        "--join",
        "under fast recovery on etcd: this node joins the running job of the same command, admitted "
        "at a step boundary without a restart",
    ),
    (
        f"{HANG_FLAG} S",
        "a rank stuck S seconds in one collective reports the hang and the job stops (default 600, 0: off)",
    ),
    (
        "--check",
        "check replicas, gradients, data, optimizer and collectives as it runs; a wrong-results or "
        "hanging bug exits 3 (docs/check.md)",
    ),
    (
        f"{STEPS_FLAG} N",
        f"the optimizer steps --check covers (default {DEFAULT_STEPS}; 'all'), plus one epoch boundary",
    ),
    ("--debug", "torch's and NCCL's verbose switches for the backend in use, and where the logs go"),
    ("-h, --help", "show this help and exit (after the script, --help is the script's)"),
)


def help_text() -> str:
    """`disttrain run --help`: disttrain's own flags, then the torchrun flags that pass
    through (read from torchrun's own parser, so the list cannot drift)."""
    from disttrain.runtime.torch_compat import torchrun_flags  # imports torch: only when asked

    width = max(len(flag) for flag, _ in OWN_FLAGS) + 2
    own = "\n".join(f"  {flag.ljust(width)}{meaning}" for flag, meaning in OWN_FLAGS)
    flags = torchrun_flags()
    passed = sorted(
        f for f in flags if f.startswith("--") and f != "--help" and not ("_" in f and f.replace("_", "-") in flags)
    )  # one spelling each
    return (
        f"{USAGE}\n\n"
        "Launch a training script on torchrun with safe defaults: a free port on one node,\n"
        "OMP_NUM_THREADS per process, workers that die with the launcher, one line per\n"
        "failure, a mistake never retried. At start it prints each rank's pid (the\n"
        "processes are named rankR.localL in ps -e, top and pgrep).\n\n"
        "Several nodes: the same command on each, with a --rdzv-id of this job's own (a\n"
        "rendezvous stays closed after its job ends) and DISTTRAIN_JOB_SECRET exported\n"
        "the same on every node, so that one rank's error ends every node with its\n"
        "traceback and line (docs/elastic.md).\n\n"
        f"disttrain flags:\n{own}\n\n"
        "Every torchrun flag passes through unchanged (python -m torch.distributed.run\n"
        "--help explains them):\n" + "\n".join(f"  {line}" for line in _columns(passed)) + "\n"
    )


def show() -> int:
    print(help_text(), end="")
    return 0


def _columns(words: list[str], width: int = 86) -> list[str]:
    lines, line = [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = ""
        line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])
