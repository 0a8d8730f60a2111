"""`disttrain train CONFIG.toml [--section.key=value ...]`: validate, then train.

The config is loaded and validated in this process first, and the user code it names
(model.factory, data.factory, train.loss) is imported, so a typo never starts a worker.
With `parallel.nproc > 1` outside torchrun the job is relaunched through `disttrain run`
as `python -m disttrain.train`; otherwise it trains here.
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain.config import load_config
from disttrain.errors import UserError

WORKER_MODULE = "disttrain.train"


def main(argv: list[str]) -> int:
    """CLI entry. Raises `UserError` (printed as one line by the CLI) for a bad config."""
    if not argv or argv[0].startswith("-"):
        raise UserError("usage: disttrain train CONFIG.toml [--section.key=value ...]")
    cfg = load_config(argv[0], argv[1:])
    config_dir = Path(argv[0]).parent
    if cfg.model.factory or cfg.data.factory or cfg.train.loss:  # user code: import it here first
        from disttrain.train.sources import check_references

        check_references(cfg, config_dir)
    from disttrain.launch.preflight import preflight

    preflight(cfg)  # writable out_dir and checkpoint root; the first step fits in memory
    if "WORLD_SIZE" not in os.environ and cfg.parallel.nproc > 1:
        # The newest checkpoint against this config, here, so that a refused change is
        # one line and a finished run starts no worker (each rank checks again).
        from disttrain.train import resume

        plan = resume.inspect(cfg)
        if plan is not None and plan.step >= cfg.train.steps:
            print(resume.complete_message(plan))
            return 0
        from disttrain.launch.run_command import main as launch

        return launch(["--nproc", str(cfg.parallel.nproc), "-m", WORKER_MODULE, *argv])
    from disttrain.train.trainer import train

    train(cfg, config_dir=config_dir)
    return 0
