"""`disttrain train CONFIG.toml [--section.key=value ...]`: validate, then train.

The config is loaded and validated in this process first, so a typo never starts a
worker. With `parallel.nproc > 1` outside torchrun the job is relaunched through
`disttrain run` as `python -m disttrain.train`; otherwise it trains here.
"""

from __future__ import annotations

import os

from disttrain.config import load_config
from disttrain.errors import UserError

WORKER_MODULE = "disttrain.train"


def main(argv: list[str]) -> int:
    """CLI entry. Raises `UserError` (printed as one line by the CLI) for a bad config."""
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: disttrain train CONFIG.toml [--section.key=value ...]")
    cfg = load_config(argv[0], argv[1:])
    if "WORLD_SIZE" not in os.environ and cfg.parallel.nproc > 1:
        from disttrain.launch.run_command import main as launch

        return launch(["--nproc", str(cfg.parallel.nproc), "-m", WORKER_MODULE, *argv])
    from disttrain.train.trainer import train

    train(cfg)
    return 0
