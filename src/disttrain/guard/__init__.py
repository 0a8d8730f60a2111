"""Checks that turn silent divergence and hangs into errors (docs/guard.md).

    run_guard.py    start fingerprint, DDP replica checksums, RunGuard / start_guard
    watchdog.py     a thread that names a hung step, dumps stacks, exits 124
    hang_report.py  the lagging-rank verdict from every rank's dump
    sanity.py       'does this look distributed?' checks on world size, threads, wrap, first batch
"""

from disttrain.guard.run_guard import (RunGuard, check_consistency, check_replicas, path_nbytes,
                                      start_guard, tensor_nbytes)

__all__ = ["RunGuard", "check_consistency", "check_replicas", "path_nbytes", "start_guard",
           "tensor_nbytes"]
