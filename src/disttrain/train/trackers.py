"""Experiment trackers: Weights & Biases and MLflow receive what `metrics.jsonl` gets,
from rank 0 (`dt.Job(..., trackers=...)`, `[log] wandb` / `[log] mlflow`).

A run is one tracker run across all its attempts: the tracker run ids are kept beside
the checkpoints, in `trackers.json`, and a resumed, restarted or recovered attempt
opens the same W&B run (`resume="allow"` with the kept id) and the same MLflow run.
Each step reaches a tracker once: the steps an attempt trains again after a kill are
not sent again to a tracker that holds them, and the steps a tracker lost with the
killed process are sent again from `metrics.jsonl` (see `Trackers`).

Forwarded: every numeric value of each metrics record at its step (loss, lr,
throughput, held-out metrics, `attempt`, `world_size`), the run's whole config and the
script's `job.log_config` values (W&B config; MLflow params, each key once: MLflow
cannot change one), and one line per attempt: the start, each restart and each
world-size change (W&B summary `run/events`, MLflow tags `disttrain.attempt.N`).

The packages are optional extras (`pip install disttrain[wandb]`, `disttrain[mlflow]`),
imported only on rank 0 of a run that uses them; a missing one is one `UserError`
when the job is built, as is a tracker that cannot start (`tracker_checks`). Neither
needs a network in its offline form: W&B with `WANDB_MODE=offline` (or
`WandbTracker(mode="offline")`) writes `out_dir/wandb/`, and MLflow with a `file://`
tracking URI writes a file store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from disttrain.errors import UserError
from disttrain.jsonl import read_jsonl

STATE_FILE = "trackers.json"
"""Beside the checkpoints: {"wandb": {"id", "step"}, "mlflow": {"id", "step"}}."""
METRICS = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class WandbTracker:
    """Send the run to Weights & Biases (`dt.Job(..., trackers=[dt.WandbTracker(...)])`,
    or `trackers="wandb"` for the defaults).

    `project` None: WANDB_PROJECT, else "disttrain". `entity`, `name`, `tags` as in
    `wandb.init`; `mode` None: WANDB_MODE (online, offline or disabled). The W&B files
    go under the job's `out_dir/wandb`. Needs `pip install disttrain[wandb]`; the run id
    is chosen once and kept in the checkpoint folder's `trackers.json`."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True, kw_only=True)
class MlflowTracker:
    """Send the run to MLflow (`dt.Job(..., trackers=[dt.MlflowTracker(...)])`, or
    `trackers="mlflow"` for the defaults).

    `experiment`: the experiment's name (created when missing). `tracking_uri` None:
    MLFLOW_TRACKING_URI, else MLflow's default; a `file://` URI is a file store (MLflow
    3 asks for MLFLOW_ALLOW_FILE_STORE=true for it). `run_name` None: the out_dir's
    name. Needs `pip install disttrain[mlflow]`; the run id is kept in the checkpoint
    folder's `trackers.json`."""

    experiment: str = "disttrain"
    tracking_uri: str | None = None
    run_name: str | None = None


_PACKAGES = {WandbTracker: ("wandb", "wandb"), MlflowTracker: ("mlflow", "mlflow")}
"""tracker -> (module to import, extra to install)."""


def resolve(trackers: Any) -> list:
    """`dt.Job`'s `trackers=`: None, "wandb", "mlflow", a tracker object, or a list of
    them -> a list of tracker objects. Raises `UserError` for anything else and for a
    tracker whose package is not installed (naming the extra to install)."""
    if trackers is None:
        return []
    items = [trackers] if isinstance(trackers, (str, WandbTracker, MlflowTracker)) else list(trackers)
    named = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    out = []
    for item in items:
        if isinstance(item, str) and item in named:
            item = named[item]()
        if not isinstance(item, (WandbTracker, MlflowTracker)):
            raise UserError(
                f'dt.Job(trackers=...): {item!r} is not a tracker; pass "wandb", '
                f'"mlflow", dt.WandbTracker(...), dt.MlflowTracker(...) or a list of them.'
            )
        module, extra = _PACKAGES[type(item)]
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"the {extra} tracker needs the {module} package, which is not installed: "
                f"pip install 'disttrain[{extra}]' (or drop it from the trackers)."
            )
        out.append(item)
    return out


def from_config(log) -> list:
    """The trackers a config's `[log]` section names (`[log] wandb`, `[log] mlflow`)."""
    out: list = []
    if log.wandb:
        out.append(WandbTracker(project=log.wandb, entity=log.wandb_entity or None, mode=log.wandb_mode or None))  # type: ignore[arg-type]
    if log.mlflow:
        out.append(MlflowTracker(experiment=log.mlflow, tracking_uri=log.mlflow_tracking_uri or None))
    return out


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}: MLflow params are flat strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


def _numbers(record: dict) -> dict[str, float]:
    """The record's scalar numbers (lists, such as per-rank step times, and NaN left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    }


class _Wandb:
    durable = False  # wandb-core buffers; only finish() is sure to have written everything

    def __init__(self, spec: WandbTracker, run_id: str | None, out_dir: Path, config: dict):
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=spec.project or os.environ.get("WANDB_PROJECT") or "disttrain",
            entity=spec.entity,
            name=spec.name,
            tags=list(spec.tags) or None,
            mode=spec.mode,
            id=run_id or secrets.token_hex(6),
            resume="allow",
            dir=str(out_dir),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.config.update(config, allow_val_change=True)  # a resume may change the lr
        self.id = self.run.id
        # A resumed online run: the server holds every step before its next one, which a
        # killed process may have sent beyond the mark in trackers.json (offline: unknown).
        self.received = max(int(self.run.starting_step) - 1, 0) if self.run.resumed else 0

    def add_config(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def events(self, texts: list[str]) -> None:
        self.run.summary.update({"run/events": texts, "run/attempt": len(texts) - 1})

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    durable = True  # each log_batch has reached the store when it returns

    def __init__(self, spec: MlflowTracker, run_id: str | None, out_dir: Path, config: dict):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param, self.client = Metric, Param, MlflowClient(tracking_uri=spec.tracking_uri)
        self.received = 0  # each log_batch is durable: trackers.json's mark is exact
        if run_id is not None:
            self.client.update_run(run_id, "RUNNING")
            self.id = run_id
        else:
            found = self.client.get_experiment_by_name(spec.experiment)
            experiment = found.experiment_id if found else self.client.create_experiment(spec.experiment)
            name = spec.run_name or out_dir.resolve().name
            self.id = self.client.create_run(experiment, run_name=name).info.run_id
        self.add_config(config)

    def add_config(self, values: dict) -> None:
        """The params the run does not hold yet: MLflow refuses to change a param's value."""
        held = self.client.get_run(self.id).data.params
        params = [self.Param(k, v) for k, v in _flat(values).items() if k not in held]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.id, params=params[i : i + 100])

    def events(self, texts: list[str]) -> None:
        for attempt, text in enumerate(texts):
            self.client.set_tag(self.id, f"disttrain.attempt.{attempt}", text)

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[self.Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


_KINDS = {WandbTracker: ("wandb", _Wandb), MlflowTracker: ("mlflow", _Mlflow)}


class Trackers:
    """Rank 0's open tracker runs for one job (see the module docstring). Build it with
    the trackers `resolve` returned, the checkpoint folder, the job's `out_dir` and its
    config; `begin` once per attempt, `log` per metrics record, `close` at the end.
    A tracker's own failure (a server that refuses, a full disk) propagates.

    `trackers.json` keeps, per tracker, its run id and the last step it surely holds:
    after each write for MLflow, at `close` for W&B (whose own process buffers, and
    loses the buffer when a kill takes the rank's process group). `begin` sends again,
    from `metrics.jsonl`, the steps a tracker may have lost that the attempt will not
    train again; W&B keeps the first value of a step it already has. Within one process
    (an in-memory recovery) nothing was lost: a step already sent is not sent again."""

    def __init__(self, specs: list, checkpoint_dir: Path, out_dir: Path, config: dict):
        self.path, self.out_dir = Path(checkpoint_dir) / STATE_FILE, Path(out_dir)
        try:
            self.state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.state = {}
        self.open: dict[str, Any] = {}
        self.sent: dict[str, int] = {}
        for spec in specs:
            key, kind = _KINDS[type(spec)]
            kept = self.state.get(key) or {}
            self.open[key] = kind(spec, kept.get("id"), self.out_dir, config)
            self.state[key] = {"id": self.open[key].id, "step": max(kept.get("step", 0), self.open[key].received)}
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)  # never a half-written file: a kill keeps the old one

    def begin(self, events: list[str], step: int) -> None:
        """An attempt starts at `step`: every attempt's line (`run_events.jsonl`), then the
        records of steps up to `step` that a tracker may not hold (the newest per step)."""
        records = {int(r["step"]): r for r in read_jsonl(self.out_dir / METRICS) if "step" in r}
        for key, run in self.open.items():
            run.events(events)
            for s in sorted(s for s in records if self._held(key) < s <= step):
                run.log(_numbers(records[s]), s)
            self.sent[key] = max(self._held(key), step)
        self._mark(step)

    def _held(self, key: str) -> int:
        """The last step tracker `key` holds: its mark in trackers.json, or what this
        process sent it (an in-memory recovery keeps the process and the tracker's buffer)."""
        return max(self.state[key]["step"], self.sent.get(key, 0))

    def _mark(self, step: int, *, durable_only: bool = True) -> None:
        for key, run in self.open.items():
            if (run.durable or not durable_only) and step > self.state[key]["step"]:
                self.state[key]["step"] = step
        self._save()

    def log(self, record: dict) -> None:
        """Forward `record`'s numbers at its step to each tracker that does not hold it."""
        step, values = int(record["step"]), _numbers(record)
        for key, run in self.open.items():
            if step > self._held(key):
                run.log(values, step)
                self.sent[key] = step
        if any(run.durable for run in self.open.values()):
            self._mark(step)

    def add_config(self, values: dict) -> None:
        """`job.log_config(values)` after the runs opened: into each tracker's config."""
        for run in self.open.values():
            run.add_config(values)

    def close(self) -> None:
        """Finish each tracker run (W&B: `finish`, MLflow: FINISHED); safe to call twice."""
        for run in self.open.values():
            run.close()
        self._mark(max(self.sent.values(), default=0), durable_only=False)
        self.open = {}


_ACTIVE: dict[Path, Trackers] = {}


def open_trackers(specs: list, checkpoint_dir: Path, out_dir: Path, config: dict) -> Trackers | None:
    """The job's `Trackers` (None without specs). An in-memory recovery's next attempt in
    the same process gets the runs still open, not a second `wandb.init`."""
    if not specs:
        return None
    key = Path(checkpoint_dir).resolve()
    if key not in _ACTIVE or not _ACTIVE[key].open:
        _ACTIVE[key] = Trackers(specs, checkpoint_dir, out_dir, config)
    return _ACTIVE[key]
