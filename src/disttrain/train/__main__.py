"""`python -m disttrain.train CONFIG.toml [--section.key=value ...]`: one rank of
`disttrain train`, as torchrun starts it (`disttrain train` validates and launches).
A `UserError` prints one line and exits 2.
"""

import sys

from disttrain.config import load_config
from disttrain.errors import UserError, run_command


def _main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python -m disttrain.train CONFIG.toml [--section.key=value ...]")
    from disttrain.train.trainer import train

    from pathlib import Path

    train(load_config(argv[0], argv[1:]), config_dir=Path(argv[0]).parent)
    return 0


sys.exit(run_command("train", _main, sys.argv[1:]))
