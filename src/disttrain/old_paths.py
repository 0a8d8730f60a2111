"""Module paths that moved, kept importable for one release without an import hook.

The old file stays as a stub of three lines whose module `__getattr__` is `forward`:
`from disttrain.train.loop import Accumulator` still works and warns
`DeprecationWarning` naming the new path, and `import disttrain` installs nothing
(no finder on `sys.meta_path`). `MOVED` is the one table of moves; CHANGELOG.md lists
them, and each goes away in the release after the one that announced it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

# old module -> its new module, or {name: new module} for a module split in several
MOVED: dict[str, str | dict[str, str]] = {
    "disttrain.parallel.zero": "disttrain.parallel.optimizers",
    # 0.2: names that say what each side of the notes holds
    "disttrain.launcher_notes": "disttrain.worker_notes",
    "disttrain.launch.user_notes": "disttrain.launch.notes_watch",
    # 0.2: the Hugging Face facts the trainer shares with the export; hf_export keeps export_hf
    "disttrain.checkpoint.hf_export": {
        name: "disttrain.config.hf_model_config"
        for name in (
            "HF_PREFIX",
            "causal_lm_from_config",
            "hf_config_from_section",
            "hf_section",
            "import_transformers",
            "resolve_hf_path",
        )
    },
    "disttrain.train.loop": "disttrain.train.accumulation",
    "disttrain.train.metrics": {
        **dict.fromkeys(("global_sum", "global_mean", "MeanTracker"), "disttrain.train.global_metrics"),
        **dict.fromkeys(("JsonlWriter", "print_main"), "disttrain.train.rank0_output"),
        **dict.fromkeys(("StepClock", "peak_memory_mb"), "disttrain.train.run_log"),
    },
}


def new_home(old: str, name: str) -> str:
    """The module that now holds `name` of the moved module `old`."""
    target = MOVED[old]
    if isinstance(target, str):
        return target
    if name not in target:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    return target[name]


def forward(old: str) -> Callable[[str], Any]:
    """The `__getattr__` of the stub left at `old`: each name read there warns once per
    call site and comes from its new module."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        new = new_home(old, name)
        warnings.warn(
            f"{old} moved to {new}; import {name} from there (the old path goes away "
            f"in the next release, see CHANGELOG.md).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__
