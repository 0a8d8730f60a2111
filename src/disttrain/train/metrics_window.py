"""A `dt.Job`'s metrics between two records: the values `job.log` collected, written
every `log_every` steps as one record (metrics.jsonl, the run log, TensorBoard, the
trackers, the progress bar), and the newest value of each metric for the summary.

A record is a collective (one all-reduce of every value's (sum, count)): every rank
writes it at the same steps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from disttrain.errors import UserError
from disttrain.train import run_summary
from disttrain.train.global_metrics import global_sum
from disttrain.train.progress import TrainProgress
from disttrain.train.rank0_output import JsonlWriter
from disttrain.train.run_log import RunLog

if TYPE_CHECKING:
    from disttrain.runtime import RankInfo
    from disttrain.train.accumulation import Accumulator
    from disttrain.train.trackers import Trackers


class MetricsWindow:
    """One attempt's metrics: the open window (`add`), its records (`after_step`), the
    newest values (`final`), the run log, the trackers and the progress bar. Built when
    `job.steps()` starts training."""

    def __init__(
        self,
        info: RankInfo,
        out_dir: Path,
        *,
        max_steps: int,
        start_step: int,
        resumed: bool,
        samples_per_step: int,
        tokens_per_sample: int,
        log_every: int,
        accumulator: Accumulator,
        trackers: Trackers | None,
        tensorboard: bool,
        progress: bool,
    ):
        """`trackers`: rank 0's open tracker runs (None elsewhere); `accumulator`: where
        each record reads the learning rate and the gradient norm; `progress`: rank 0's
        progress bar on."""
        self.info, self.out_dir, self.max_steps, self.log_every = info, out_dir, max_steps, log_every
        self.accumulator, self.tokens_per_sample = accumulator, tokens_per_sample
        self.start_step, self.resumed = start_step, resumed
        self.window: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.samples_per_step = samples_per_step
        self.trackers = trackers
        self.run_log = RunLog(out_dir, info, start_step, resumed, tensorboard, trackers)
        self.last_logged, self.t_window = start_step, time.perf_counter()
        self.progress = TrainProgress(
            max_steps,
            enabled=info.is_main and progress,
            start=start_step,
            unit="token" if tokens_per_sample else "sample",
        )

    def start(self, heldout: dict[str, float]) -> None:
        """Before the first step: the evaluation at the start into the newest values and,
        on a fresh run, the run's start record."""
        self.final.update(heldout)
        if self.start_step == 0 and not self.resumed:
            run_summary.record_start(
                self.out_dir, {k.removeprefix("heldout_"): v for k, v in heldout.items()}, self.info.is_main
            )

    def add(self, values: dict) -> None:
        """`job.log(**values)`: each value into the window; `UserError` for a value that
        is not a number or a one-element tensor."""
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UserError(
                    f"dt.Job.log({key}=...) got {type(value).__name__}; pass a number "
                    f"or a one-element tensor, e.g. job.log(loss=loss)."
                )
            acc = self.window.setdefault(key, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + float(value), acc[1] + 1.0

    def after_step(self, step: int, heldout: dict[str, float]) -> None:
        """A committed step: the progress bar, then a record when an evaluation ran or
        the window is due (every `log_every` steps and at the last)."""
        self.progress.advance(step)
        self.final.update(heldout)
        if heldout or (self.window and (step % self.log_every == 0 or step >= self.max_steps)):
            self.write(step, heldout)

    def write(self, step: int, heldout: dict[str, float]) -> None:
        """One metrics record (a collective: see the module)."""
        keys = sorted(self.window)  # the same order on every rank
        totals = global_sum([v for k in keys for v in self.window[k]])
        record = {k: totals[2 * i] / totals[2 * i + 1] for i, k in enumerate(keys)}
        now = time.perf_counter()
        rate = (step - self.last_logged) * self.samples_per_step / max(now - self.t_window, 1e-9)
        lr = self.accumulator.optimizer.param_groups[0]["lr"]
        record.update(step=step, lr=lr, world_size=self.info.world_size, samples_per_s=rate, **heldout)
        if self.tokens_per_sample:
            record["tokens_per_s"] = rate * self.tokens_per_sample
        self.window, self.last_logged, self.t_window = {}, step, now
        self.final.update({k: record[k] for k in keys})
        self.run_log.log(record, self.accumulator.last_grad_norm)
        JsonlWriter(self.out_dir / "metrics.jsonl").write(record)
        if self.info.is_main:  # the run's wall time counts the attempts' own (run_summary)
            run_summary.record_attempt_time(self.out_dir, self.run_log.attempt, now - self.t0)
        self.progress.update(
            step,
            self.final.get("loss", float("nan")),
            self.final.get("heldout_loss", float("nan")),
            record.get("tokens_per_s", rate),
        )

    def close(self) -> None:
        """The progress bar and the trackers (a preempted run continues the same tracker
        run when resumed)."""
        self.progress.close()
        if self.trackers is not None:
            self.trackers.close()
