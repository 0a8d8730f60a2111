"""Checks that turn silent divergence and hangs into errors (docs/guard.md).

    run_guard.py        start fingerprint, DDP replica checksums, RunGuard / start_guard
    watchdog.py         a thread that names a hung step, dumps stacks, exits 124
    script_watchdog.py  the same for a plain script under `disttrain run` (no steps)
    side_channel.py     the heartbeat folder: made, shared and removed under a lock
    private_dir.py      where that folder lives (private to this user and job), safe file opens
    hang_report.py      the lagging-rank verdict from every rank's dump
    stacks.py           the local ranks' Python stacks (py-spy, else faulthandler)
    sanity.py           'does this look distributed?' checks on world size, threads, wrap, first batch

The names below load run_guard (and torch) on first use, so the launcher's use of
script_watchdog imports no torch.
"""

__all__ = ["RunGuard", "check_consistency", "check_replicas", "path_nbytes", "start_guard", "tensor_nbytes"]


def __getattr__(name: str):
    if name in __all__:
        from disttrain.guard import run_guard

        return getattr(run_guard, name)
    raise AttributeError(f"module 'disttrain.guard' has no attribute {name!r}")
