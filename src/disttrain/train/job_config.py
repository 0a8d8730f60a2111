"""What a `dt.Job` is configured by: the TOML's own sections (`disttrain.config.Config`),
a few short keywords for a script, and `RunOptions`, what only an adapter such as
`disttrain train` passes.

Precedence: a short keyword (not None) > the `config` given > `Config()`'s defaults,
the TOML's: one default per setting whichever way a Job is made. A keyword of the old
constructor (`keep_last=`, `checkpoint_dir=`, `compile=`, ...) is one `UserError`
naming the field it moved to.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.config import Config
from disttrain.errors import UserError


@dataclass(kw_only=True)
class RunOptions:
    """What an adapter (`disttrain train`, a framework integration) passes to `dt.Job`
    beyond the configuration: `dt.Job(out_dir, config, run=dt.RunOptions(...))`. A
    script needs none of it."""

    stored_config: dict | None = None
    """The dict each checkpoint stores and a resume compares (None: the job's settings
    and its optimizer's hyper-parameters); given, the job speaks as 'train'."""
    guard_fields: dict = field(default_factory=dict)
    """Values every rank must agree on at start (the guard's fingerprint)."""
    summary_config: dict | None = None
    """The config written into `summary.json` (None: `stored_config` or the job's)."""
    summary_extra: dict = field(default_factory=dict)
    """Extra entries of `summary.json`."""
    exit_on_preempt: bool = True
    """False: on SIGTERM `steps()` returns after the save and `job.preempted` is True,
    instead of `SystemExit(0)`."""
    tokens_per_sample: int = 0
    """Throughput, progress bar and summary count tokens (0: samples)."""
    wrap_options: dict = field(default_factory=dict)
    """More `dt.wrap` keywords, e.g. {"compile": {"backend": "aot_eager"}} (torch.compile
    options); the [parallel] section's fields come from the config."""


SHORT = {
    "strategy": ("parallel", "strategy"),
    "precision": ("train", "precision"),
    "accum_steps": ("train", "accum_steps"),
    "checkpoint_every": ("checkpoint", "every"),
    "seed": ("train", "seed"),
    "grad_clip": ("optim", "grad_clip"),
    "record_samples": ("elastic", "record_samples"),
    "tensorboard": ("log", "tensorboard"),
    "check": ("guard", "check"),
    "tp": ("parallel", "tp"),
    "sequence_parallel": ("parallel", "sequence_parallel"),
    "loss_parallel": ("parallel", "loss_parallel"),
}
"""The short keywords of `dt.Job` -> the (section, field) each overrides."""


def resolve(config: Config | None, short: dict[str, Any]) -> Config:
    """The Job's `Config`: a copy of `config` (None: `Config()`) with each short
    keyword that is not None set. Raises `UserError` for a `config` that is not a
    `Config`."""
    if config is not None and not isinstance(config, Config):
        raise UserError(
            f"dt.Job(config=...) takes a disttrain.config.Config (the TOML's sections: "
            f"Config(train=TrainConfig(...), ...)), not a {type(config).__name__}; an "
            f"adapter's dict for the checkpoints goes to run=dt.RunOptions(stored_config=...)."
        )
    cfg = copy.deepcopy(config) if config is not None else Config()
    for key, value in short.items():
        if value is not None:
            section, name = SHORT[key]
            setattr(getattr(cfg, section), name, value)
    return cfg


def checkpoint_root(cfg: Config, out_dir: Path) -> Path:
    """Where the job's checkpoints live: `checkpoint.dir`, or `out_dir/checkpoints`."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"


JOB_KEYS = {
    "parallel": None,
    "train": ("accum_steps", "precision", "fp8_recipe", "seed", "log_every", "compile"),
    "optim": ("grad_clip",),
    "checkpoint": None,
    "elastic": None,
    "guard": None,
    "log": None,
}
"""The config a `dt.Job` script's run applies: each section with the keys it reads
(None: all). The rest (the model, the data, train.steps, optim.lr) is `disttrain
train`'s; a script's own model, data and optimizer make them meaningless there."""


def tracker_config(cfg: Config, stored: dict, user: dict, *, whole: bool = False) -> dict:
    """The run's config for the trackers: the sections of `cfg` the job applies
    (`JOB_KEYS`; `whole`: `stored` is a `disttrain train` config already, the whole
    run), merged with `stored` (what the checkpoints store: the job's strategy, the
    optimizer's real hyper-parameters, `optim.lr` included), then the script's own
    `user` values at the top level."""
    out: dict[str, Any] = {}
    if not whole:
        for section, keys in JOB_KEYS.items():
            values = dataclasses.asdict(getattr(cfg, section))
            out[section] = {k: v for k, v in values.items() if keys is None or k in keys}
        out["parallel"].pop("nproc", None)  # the launcher's; the job's world size is the metrics'
    for section, values in stored.items():
        if isinstance(values, dict) and isinstance(out.get(section), dict):
            out[section] = {**out[section], **values}
        else:
            out[section] = values
    return {**out, **user}
