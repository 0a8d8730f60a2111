"""The job both sides of the product A/B run: `disttrain train` (trainer_run.py) and
the same work written by hand (hand_train.py).

examples/tiny_gpt.toml with SETTINGS on top: the GPT of the other sections (context
64), 8 sequences per rank per step, an evaluation and a checkpoint every EVERY steps,
the metrics all-reduce every LOG_EVERY steps. The clock runs from the log line of step
LOG_EVERY to the log line of the last step, so it holds steps LOG_EVERY+1 .. STEPS and
the evaluations and checkpoints of steps LOG_EVERY .. STEPS-1 (the final evaluation and
save come after it on both sides). Its mean is the step time with every cost amortised,
in wall seconds and in CPU seconds of the process (all its threads).

Environment: BENCH_STEPS (as for every workload; 20 gives 110 steps, a checkpoint and
an evaluation every 50), BENCH_TRAIN_ARGS (extra `--section.key=value` for the trainer:
the A/B switches).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import tomllib

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt.toml"
LOG_EVERY = 10
# `python -m bench --steps N` (default 20) times 5 N steps: 100 by default, with an
# evaluation and a checkpoint every 50, 2 of each inside the clock.
TIMED = 5 * max(2, int(os.environ.get("BENCH_STEPS", "20")))
STEPS = LOG_EVERY + TIMED
EVERY = max(LOG_EVERY, TIMED // 2 // LOG_EVERY * LOG_EVERY)
SETTINGS = {
    "model.block_size": 64,
    "data.max_bytes": 1_000_000,
    "train.batch_size": 8,
    "train.steps": STEPS,
    "train.eval_every": EVERY,
    "train.eval_batches": 4,
    "train.log_every": LOG_EVERY,
    "checkpoint.every": EVERY,
    "checkpoint.keep_last": 2,
    "elastic.record_samples": True,
    "train.out_dir": "run",
    # A replica checksum inside the clock: every EVERY steps (the default, 100, would fall
    # past a short run), so the guard is measured at a cadence at least its default's.
    "guard.divergence_every": EVERY,
}


def overrides() -> list[str]:
    """SETTINGS as trainer overrides, then this launch's BENCH_TRAIN_ARGS."""
    out = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in SETTINGS.items()]
    return out + os.environ.get("BENCH_TRAIN_ARGS", "").split()


def config() -> dict:
    """The TOML with SETTINGS applied, as nested dicts (for the hand-written loop)."""
    cfg = tomllib.loads(CONFIG.read_text())
    for key, value in SETTINGS.items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    return cfg


def step_seconds(log_times: dict[int, float]) -> float:
    """Mean seconds per step between the log line of LOG_EVERY and that of STEPS."""
    return (log_times[STEPS] - log_times[LOG_EVERY]) / (STEPS - LOG_EVERY)


def clocks() -> tuple[float, float]:
    """(wall, CPU) now: `time.process_time` counts every thread of this process (the
    watchdog's, gloo's), and little of the other jobs on a shared machine."""
    return time.perf_counter(), time.process_time()


def result(rank: int, world: int, log_times: dict[int, tuple[float, float]], tokens: int) -> dict:
    """This rank's JSON for bench.launch: wall and CPU seconds per timed step, peak RSS."""
    return {
        "rank": rank,
        "world": world,
        "first_step_s": 0.0,
        "tokens_per_step": tokens,
        "step_s": [step_seconds({k: v[0] for k, v in log_times.items()})],
        "cpu_s": step_seconds({k: v[1] for k, v in log_times.items()}),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
