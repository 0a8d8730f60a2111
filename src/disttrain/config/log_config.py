"""The `[log]` section: what rank 0 records besides metrics.jsonl (docs/observability.md).

Kept out of schema.py so that file stays one page; schema.py makes it a `Config` section.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from disttrain.errors import ConfigError


@dataclass(kw_only=True)
class LogConfig:
    """[log]: run records for people and tools (TensorBoard, Weights & Biases, MLflow)
    beside metrics.jsonl; none of them changes training."""

    tensorboard: bool = True
    """Rank 0 writes TensorBoard event files under {train.out_dir}/tb (losses, LR,
    gradient norm, throughput, per-rank step time and peak memory, restarts and
    world-size changes). false writes none."""

    wandb: str = ""
    """The Weights & Biases project rank 0 sends the run to ('' = none): each metrics record,
    the config, restarts and world-size changes; a resumed run continues the same W&B run.
    Needs disttrain[wandb]."""
    wandb_mode: str = ""
    """'online' (send to the W&B server: needs an API key, checked before the ranks start),
    'offline' (write {train.out_dir}/wandb only; `wandb sync` uploads it later) or
    'disabled'; '' = WANDB_MODE, else online."""
    wandb_entity: str = ""
    """The W&B entity (user or team) of [log] wandb; '' = W&B's default."""
    mlflow: str = ""
    """The MLflow experiment rank 0 sends the run to ('' = none), as [log] wandb; a resumed
    run continues the same MLflow run. Needs disttrain[mlflow]."""
    mlflow_tracking_uri: str = ""
    """Where MLflow stores runs: a server URL or file:///path (a file store); '' =
    MLFLOW_TRACKING_URI, else MLflow's default."""


_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
WANDB_MODES = ("online", "offline", "disabled")


def check_log(log: LogConfig) -> None:
    """[log] wandb / mlflow need their package, and log.wandb_mode is a W&B mode: one
    `ConfigError` naming the key and the fix, in the launching process (nothing is
    imported; the machine's checks, an API key or a server, are `launch/preflight.py`'s)."""
    if log.wandb_mode not in ("", *WANDB_MODES):
        raise ConfigError(
            f"config key 'log.wandb_mode' is {log.wandb_mode!r}; choose one of {', '.join(WANDB_MODES)} "
            f"(or leave it unset for WANDB_MODE)."
        )
    for key, module in _EXTRAS.items():
        if getattr(log, key) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"config key 'log.{key}' is set but the {module} package is not installed: "
                f"pip install 'disttrain[{key}]', or remove log.{key}."
            )
