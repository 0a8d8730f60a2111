"""`python -m disttrain.train CONFIG.toml [--section.key=value ...]`: one rank of
`disttrain train`, as torchrun starts it (`disttrain train` validates and launches).
On its first attempt a rank takes the config and the resume inspection the launcher
handed over (`train.launched`) instead of parsing and inspecting again; after a
restart, or started otherwise, it parses the config itself.
A `UserError` prints one line and exits 2.
"""

import sys
from pathlib import Path

from disttrain.errors import UserError, one_line


def _main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: python -m disttrain.train CONFIG.toml [--section.key=value ...]")
    from disttrain.train import launcher_findings
    from disttrain.train.trainer import train

    handed = launcher_findings.read(argv)
    if handed is None:
        from disttrain.config import load_config

        train(load_config(argv[0], argv[1:]), config_dir=Path(argv[0]).parent)
    else:
        train(handed.cfg, config_dir=Path(argv[0]).parent, inspected=handed.inspected)
    return 0


with one_line("train") as result:  # inline, not a wrapper: it stays off the call chain
    result.code = _main(sys.argv[1:])
sys.exit(result.code)
