"""Module paths of release 0.1 that moved in 0.2, kept importable for one release.

`import disttrain.sampler` (or `from disttrain.loop import Accumulator`) still works
and warns `DeprecationWarning` naming the new path. The alias is a thin module whose
attributes are looked up in the new one, so the real module keeps its own name.
Removed in 0.3; CHANGELOG.md lists every move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "disttrain.configfile": "disttrain.config.tomlfile",
    "disttrain.precision": "disttrain.parallel.precision",
    "disttrain.sampler": "disttrain.data.elastic_sampler",
    "disttrain.preempt": "disttrain.elastic.preemption",
    "disttrain.faults": "disttrain.runtime.fault_injection",
    "disttrain.watchdog": "disttrain.guard.watchdog",
    "disttrain.hangreport": "disttrain.guard.hang_report",
    "disttrain.sanity": "disttrain.guard.sanity",
    "disttrain.loop": "disttrain.train.loop",
    "disttrain.metrics": "disttrain.train.metrics",
    "disttrain.progress": "disttrain.train.progress",
    "disttrain.trainer": "disttrain.train.trainer",
    "disttrain.etcd_server": "disttrain.launch.etcd_server",
    "disttrain.models": "disttrain.demo",
    "disttrain.models.gpt": "disttrain.demo.gpt",
    "disttrain.models.mlp": "disttrain.demo.mlp",
    "disttrain.checkpoint.faults": "disttrain.checkpoint.fault_points",
    "disttrain.checkpoint.errors": "disttrain.checkpoint.checkpoint_errors",
    "disttrain.doctor.report": "disttrain.doctor.doctor_report",
    "disttrain.plan.report": "disttrain.plan.plan_report",
    "disttrain.checkpoint.cli": "disttrain.checkpoint.ckpt_command",
    "disttrain.plan.cli": "disttrain.plan.plan_command",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module) -> None:
        warnings.warn(f"{module.__name__} moved to {self.new}; the old path goes away in "
                      f"disttrain 0.3 (see CHANGELOG.md).", DeprecationWarning, stacklevel=2)
        real = importlib.import_module(self.new)
        module.__getattr__ = lambda name: getattr(real, name)
        module.__dir__ = lambda: dir(real)
        if self.new == "disttrain.demo":
            module.__path__ = []  # a package, so that disttrain.models.gpt resolves too


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))
        return None


def install() -> None:
    """Add the finder once (idempotent); `import disttrain` calls it."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
