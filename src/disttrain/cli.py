"""The `disttrain` command: argument dispatch only, no logic.

A `UserError` anywhere below prints one clear line and exits 2, with no traceback.
"""

from __future__ import annotations

import sys

from disttrain.errors import run_command

USAGE = """usage: disttrain COMMAND [ARGS]

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


def _command(name: str):
    # Imported lazily: `disttrain doctor` must not pay for `import torch`.
    if name == "run":
        from disttrain.launch.run_command import main
    elif name == "train":
        from disttrain.launch.train_command import main
    elif name == "doctor":
        from disttrain.doctor import main
    elif name == "plan":
        from disttrain.plan import main
    elif name == "ckpt":
        from disttrain.checkpoint.ckpt_command import main
    elif name == "etcd":
        from disttrain.launch.etcd_server import main
    elif name == "check":
        from disttrain.launch.check_command import main
    elif name == "launch-file":
        from disttrain.launch.launch_files import main
    elif name == "report":
        from disttrain.report import main
    elif name == "data":
        from disttrain.data.data_command import main
    else:
        return None
    return main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command = _command(argv[0])
    if command is None:
        print(f"disttrain: unknown command {argv[0]!r}.\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return run_command(argv[0], command, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
