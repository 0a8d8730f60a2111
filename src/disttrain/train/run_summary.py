"""The summary of a run, over all its attempts: `out_dir/summary.json` and the table
rank 0 prints at the end.

A run is every attempt that wrote into one `out_dir` (restarts, in-memory recoveries,
resizes). `run_start.json` is written once, by the attempt that starts at step 0, with
the time and the held-out metrics before the first step; later attempts read it, so
the summary's starting loss is the whole run's. `wall_time_s` is the sum of the
attempts' own durations, each from its start of training to its last metrics record
(`run_clock.json`, rewritten by rank 0 at each record: a killed attempt keeps the time
it had trained), so the idle time between attempts (a day before a resume) is not
counted; `attempt_wall_time_s` is this attempt's alone.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

START = "run_start.json"
SUMMARY = "summary.json"
CLOCK = "run_clock.json"
"""{attempt number: seconds it trained}, for `wall_time_s`."""


def record_start(out_dir: Path, heldout: dict[str, float], is_main: bool) -> None:
    """At a fresh start (step 0), on rank 0: the run's start time and first metrics."""
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        clean = {k: v for k, v in heldout.items() if isinstance(v, float) and math.isfinite(v)}
        (out_dir / START).write_text(json.dumps({"time": time.time(), "heldout": clean}))


def read_start(out_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((out_dir / START).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record_attempt_time(out_dir: Path, attempt: int, seconds: float) -> None:
    """Rank 0, at each metrics record: attempt `attempt` has trained for `seconds` (an
    atomic rewrite, so a kill leaves the previous record's time)."""
    clock = _read_clock(out_dir)
    clock[str(attempt)] = seconds
    tmp = out_dir / f".{CLOCK}.tmp"
    tmp.write_text(json.dumps(clock))
    os.replace(tmp, out_dir / CLOCK)


def _read_clock(out_dir: Path) -> dict[str, float]:
    try:
        data = json.loads((out_dir / CLOCK).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def build(
    out_dir: Path,
    *,
    steps: int,
    world_size: int,
    strategy: str,
    attempt_t0: float,
    samples_per_step: int,
    tokens_per_sample: int,
    final: dict[str, float],
    resumed: bool,
    extra: dict | None = None,
    eval_names: tuple[str, ...] = ("heldout",),
    attempt: int = 0,
) -> dict[str, Any]:
    """The summary dict (see the module); `final` holds the last train loss and the
    last metrics of each evaluator (named `eval_names`), keyed as in metrics.jsonl;
    `attempt` is this attempt's number (`run_events.jsonl`)."""
    start = read_start(out_dir)
    attempt_s = time.perf_counter() - attempt_t0
    earlier = sum(s for a, s in _read_clock(out_dir).items() if a != str(attempt))
    first = start.get("heldout", {})
    summary: dict[str, Any] = {
        "steps": steps,
        "world_size": world_size,
        "strategy": strategy,
        "initial_heldout_loss": first.get("loss", float("nan")),
        "final_train_loss": final.get("loss", float("nan")),
        "final_heldout_loss": final.get("heldout_loss", float("nan")),
        "wall_time_s": earlier + attempt_s,
        "attempt_wall_time_s": attempt_s,
        "samples_seen": samples_per_step * steps,
        "resumed": resumed,
        "preempted": False,
    }
    if tokens_per_sample:
        summary["tokens_seen"] = samples_per_step * steps * tokens_per_sample
    for key, value in final.items():
        if key.startswith(tuple(f"{n}_" for n in eval_names)) and key != "heldout_loss":
            summary["final_" + key] = value
    summary.update(extra or {})
    return summary


USER_MODEL_KEYS = ("factory", "kwargs", "dropout")
HF_MODEL_KEYS = ("hf", "hf_path", "hf_config", "dropout")
USER_DATA_KEYS = ("factory", "kwargs", "drop_last", "num_workers", "pin_memory", "persistent_workers")


def applicable_config(cfg) -> dict:
    """The config as summary.json stores it: only the keys that apply to this run (a
    user's model has no GPT shape, a user's dataset no corpus keys)."""
    from disttrain.config import to_dict

    d = to_dict(cfg)
    m = cfg.model
    if m.factory or m.hf or m.hf_path:
        keep = USER_MODEL_KEYS if m.factory else HF_MODEL_KEYS
        d["model"] = {k: v for k, v in d["model"].items() if k in keep}
    if cfg.data.factory:
        d["data"] = {k: v for k, v in d["data"].items() if k in USER_DATA_KEYS}
    return d


def write(out_dir: Path, summary: dict, config: dict | None) -> None:
    """Rank 0: summary.json (with the run's config when given) and the table."""
    from disttrain.train.progress import print_summary

    body = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v  # NaN is no JSON
        for k, v in {**summary, **({"config": config} if config is not None else {})}.items()
    }
    (out_dir / SUMMARY).write_text(json.dumps(body, indent=2, default=str, allow_nan=False))
    print_summary(summary)
