"""Counts the calls of the functions that a launch should run once
(tests/faults/test_launch_once.py puts this folder on PYTHONPATH for its launches).

Does nothing unless DISTTRAIN_TEST_COUNT_CALLS names a file. Then each module of
`COUNTED`, when it is first imported in this process (the launcher, a warm-worker
server, a rank), has the named functions wrapped; each call appends one JSON line to
the file before it runs: the function, the pid, and the process's RANK and
TORCHELASTIC_RESTART_COUNT (null in the launcher). O_APPEND keeps the lines of
concurrent processes whole.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys

COUNTED = {
    "disttrain.config.schema": ("load_config",),
    "disttrain.launch.preflight": ("preflight",),
    "disttrain.train.resume_plan": ("inspect",),
    "disttrain.train.trainer": ("train",),  # shows that a rank was counted at all
}
"""module -> the functions of it that are counted."""


def _counted(path: str, module: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        line = json.dumps({"fn": f"{module}.{fn.__name__}", "pid": os.getpid(),
                           "rank": os.environ.get("RANK"),
                           "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")})
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        return fn(*args, **kwargs)

    return counted


class _Wrapper(importlib.abc.MetaPathFinder):
    """Finds a counted module as the path finder does, and wraps its functions right
    after the module's code ran (so every `from module import fn` gets the wrapper)."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, name, path, target=None):
        if name not in COUNTED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for fn in COUNTED[name]:
                setattr(module, fn, _counted(self.path, name, getattr(module, fn)))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("DISTTRAIN_TEST_COUNT_CALLS"):
    sys.meta_path.insert(0, _Wrapper(os.environ["DISTTRAIN_TEST_COUNT_CALLS"]))
