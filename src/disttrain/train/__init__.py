"""The training loop's parts and the config-driven trainer.

    loop.py      Accumulator (no_sync, loss scaled once, clip, step), warmup_cosine
    metrics.py   global (sum, count) means, rank-0 JSONL writer
    progress.py  rich progress bar and summary table
    trainer.py   `disttrain train`'s per-rank job, written on the layers below
    __main__.py  `python -m disttrain.train CONFIG.toml [overrides]`: what torchrun runs
"""
