"""`disttrain train CONFIG.toml [--section.key=value ...]`: validate, then train.

The config is loaded and validated in this process first, the user code it names
(model.factory, data.factory, train.loss) is imported, and the data on disk it names
(data.tokens, data.hf_dataset: files, splits, columns) is opened, so a typo never
starts a worker.
With `parallel.nproc > 1` outside torchrun the newest checkpoint is inspected here too,
and the job is launched through `run_command.main` (torchrun) as `python -m
disttrain.train` on each rank, handed this process's config and inspection
(`train.launched`: the ranks parse and inspect nothing on their first attempt);
otherwise it trains here.
"""

from __future__ import annotations

import os
from pathlib import Path

from disttrain.config import load_config
from disttrain.errors import UserError

WORKER_MODULE = "disttrain.train"
DEFAULT_MAX_RESTARTS = 3
"""Restarts of a multi-process `disttrain train` after a worker dies (torchrun's
--max-restarts): with periodic checkpoints on by default, a kill loses at most
checkpoint.every_s of training. A user error is never retried (worker_notes)."""


def split_restarts(argv: list[str]) -> tuple[list[str], int]:
    """`--max-restarts N` / `--max-restarts=N` taken out of the config arguments."""
    rest, restarts, i = [], DEFAULT_MAX_RESTARTS, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--max-restarts" or arg.startswith("--max-restarts="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise UserError(
                    f"--max-restarts {value!r}: give a whole number >= 0 (default "
                    f"{DEFAULT_MAX_RESTARTS}), e.g. --max-restarts 3."
                )
            restarts = int(value)
            continue
        rest.append(arg)
        i += 1
    return rest, restarts


USAGE = "usage: disttrain train CONFIG.toml [--section.key=value ...] [--max-restarts N]"


def help_text() -> str:
    """`disttrain train --help`: the usage, the options and every config key (from the
    schema: `config.key_docs`)."""
    import textwrap

    from disttrain.config.key_docs import keys_help
    from disttrain.config.path_keys import rule_text

    return (
        f"{USAGE}\n\n"
        "Validate CONFIG.toml, then train: in this process, or on parallel.nproc processes\n"
        "through `disttrain run`. A killed run resumes from its newest valid checkpoint when\n"
        "the same command starts again. Precedence: --section.key=value > CONFIG.toml > default.\n\n"
        f"{textwrap.fill(rule_text(), width=88)}\n\n"
        "options:\n"
        "  -h, --help          show this help (every config key) and exit\n"
        "  --section.key=VALUE set one config key, e.g. --train.steps=100 --optim.lr=3e-4\n"
        f"  --max-restarts N    restarts after a worker dies (default {DEFAULT_MAX_RESTARTS}); a\n"
        "                      mistake in the config or code is never retried\n\n"
        "config keys (TOML: [section] key = value; CLI: --section.key=value):\n\n" + keys_help()
    )


def main(argv: list[str]) -> int:
    """CLI entry. Raises `UserError` (printed as one line by the CLI) for a bad config."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(), end="")
        return 0
    if not argv or argv[0].startswith("-"):
        raise UserError(f"{USAGE}; `disttrain train --help` lists every config key.")
    argv, restarts = split_restarts(argv)
    cfg = load_config(argv[0], argv[1:])
    config_dir = Path(argv[0]).parent
    if cfg.model.factory or cfg.data.factory or cfg.train.loss:  # user code: import it here first
        from disttrain.train.model_data_loss import check_references

        check_references(cfg, config_dir)
    if cfg.data.tokens or cfg.data.hf_dataset:  # files, folders, splits, columns: here, once
        from disttrain.train.model_data_loss import build_datasets

        build_datasets(cfg, config_dir)  # headers and memory maps only; the workers build their own
    from disttrain.launch.preflight import preflight

    preflight(cfg)  # writable out_dir and checkpoint root; the first step fits in memory
    if "WORLD_SIZE" not in os.environ and cfg.parallel.nproc > 1:
        # The newest checkpoint against this config, here and once: a refused change is
        # one line, a finished run starts no worker, and the ranks take this result
        # (train.launched) instead of reading the checkpoint again.
        from disttrain.launch import run_command
        from disttrain.train import resume_plan
        from disttrain.train.launcher_findings import Launched

        plan = resume_plan.inspect(cfg)
        if plan is not None and plan.step >= cfg.train.steps:
            print(resume_plan.train_complete_message(plan))
            return 0
        return run_command.main(
            ["--nproc", str(cfg.parallel.nproc), "--max-restarts", str(restarts), "-m", WORKER_MODULE, *argv],
            launched=Launched(tuple(argv), cfg, resume_plan.Inspected(plan)),
        )
    from disttrain.train.trainer import train

    train(cfg, config_dir=config_dir)
    return 0
