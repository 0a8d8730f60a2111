"""The training loop's parts and the config-driven trainer.

    loop.py      Accumulator (no_sync, loss scaled once, clip, step), warmup_cosine
    metrics.py   global (sum, count) means, rank-0 JSONL writer
    job.py       dt.Job: a user's own loop with resume, checkpoints, SIGTERM and the final save
    progress.py  rich progress bar and summary table
    trainer.py   `disttrain train`'s per-rank job, written on the layers below
    __main__.py  `python -m disttrain.train CONFIG.toml [overrides]`: what torchrun runs
"""
