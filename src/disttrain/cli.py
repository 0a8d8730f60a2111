"""The `disttrain` command: argument dispatch only, no logic.

A `UserError` anywhere below prints one clear line and exits 2, with no traceback.
"""

from __future__ import annotations

import sys

from disttrain.errors import one_line

USAGE = """usage: disttrain COMMAND [ARGS]    (disttrain COMMAND --help: its options; disttrain --version)

commands:
  run      launch a script on torchrun with safe defaults (free port, threads, elastic)
  train    the config-driven trainer:  disttrain train CONFIG.toml [--section.key=value ...]
  doctor   lint a training script for distributed-training pitfalls
  plan     memory and communication per strategy, with a recommendation
  ckpt     inspect, verify or export a checkpoint:  disttrain ckpt verify DIR
  etcd     a local etcd server for the etcd rendezvous:  disttrain etcd start
  check    preflight on every node (same flags as run): rendezvous, all-reduce, versions, disk, clock
  launch-file  write a Slurm sbatch or Kubernetes PyTorchJob:  disttrain launch-file slurm CONFIG.toml --nodes N
  report   a PNG of a run (loss, throughput, step time, restarts):  disttrain report RUN_DIR
  data     tokenize text files for [data] tokens:  disttrain data prepare TEXT_FILES... --out DIR
"""


COMMANDS = {
    "run": "disttrain.launch.run_command",
    "train": "disttrain.launch.train_command",
    "doctor": "disttrain.doctor",
    "plan": "disttrain.plan",
    "ckpt": "disttrain.checkpoint.ckpt_command",
    "etcd": "disttrain.launch.etcd_server",
    "check": "disttrain.launch.check_command",
    "launch-file": "disttrain.launch.launch_files",
    "report": "disttrain.report",
    "data": "disttrain.data.data_command",
}
"""Each command and the module whose `main(argv)` runs it."""


def _command(name: str):
    # Imported lazily: `disttrain doctor` must not pay for `import torch`.
    if name not in COMMANDS:
        return None
    import importlib

    return importlib.import_module(COMMANDS[name]).main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command is a usage error, as argparse and git treat it
        print(USAGE, end="", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv[0] in ("-V", "--version"):
        from disttrain.version import __version__

        print(f"disttrain {__version__}")
        return 0
    command = _command(argv[0])
    if command is None:
        print(f"disttrain: unknown command {argv[0]!r}.\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    with one_line(argv[0]) as result:  # a UserError anywhere below: one line, exit 2
        result.code = int(command(argv[1:]) or 0)
    return result.code


if __name__ == "__main__":
    sys.exit(main())
