"""The `disttrain` command: argument dispatch only, no logic.

A `UserError` anywhere below prints one clear line and exits 2, with no traceback.
"""

from __future__ import annotations

import sys

from disttrain.errors import UserError

USAGE = """usage: disttrain COMMAND [ARGS]

commands:
  run      launch a script on torchrun with safe defaults (free port, threads, elastic)
  train    the config-driven trainer:  disttrain train CONFIG.toml [--section.key=value ...]
  doctor   lint a training script for distributed-training pitfalls
  plan     memory and communication per strategy, with a recommendation
  ckpt     inspect, verify or export a checkpoint:  disttrain ckpt verify DIR
  etcd     a local etcd server for the etcd rendezvous:  disttrain etcd start
"""


def _command(name: str):
    # Imported lazily: `disttrain doctor` must not pay for `import torch`.
    if name == "run":
        from disttrain.launch import main
    elif name == "train":
        from disttrain.trainer import main
    elif name == "doctor":
        from disttrain.doctor import main
    elif name == "plan":
        from disttrain.plan import main
    elif name == "ckpt":
        from disttrain.checkpoint.cli import main
    elif name == "etcd":
        from disttrain.etcd_server import main
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
    try:
        return int(command(argv[1:]) or 0)
    except UserError as e:
        print(f"disttrain {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
