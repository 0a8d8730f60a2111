"""A `dt.Job`'s metrics between two records: the values `job.log` collected, written
every `log_every` steps as one record (metrics.jsonl, the run log, TensorBoard, the
trackers, the progress bar), and the newest value of each metric for the summary.

A record is a collective (one all-reduce of every value's (sum, count)): every rank
writes it at the same steps.
"""

from __future__ import annotations

import time

import torch

from disttrain.errors import UserError
from disttrain.train import run_summary
from disttrain.train.global_metrics import global_sum
from disttrain.train.rank0_output import JsonlWriter
from disttrain.train.progress import TrainProgress
from disttrain.train.run_log import RunLog
from disttrain.train.trackers import open_trackers


class MetricsWindow:
    """One attempt's metrics: the open window (`add`), its records (`after_step`), the
    newest values (`final`), the run log, the trackers and the progress bar. Built when
    `job.steps()` starts training."""

    def __init__(self, job, max_steps: int):
        info = job.info
        self.job, self.max_steps = job, max_steps
        self.window: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self.samples_per_step = job.train_loader.batch_size * job.accumulator.accum_steps * info.world_size
        self.trackers = (
            open_trackers(job.trackers, job.checkpoint_dir, job.out_dir, job.tracker_config()) if info.is_main else None
        )
        self.run_log = RunLog(job.out_dir, info, job.step, job.resumed, job.cfg.log.tensorboard, self.trackers)
        self.last_logged, self.t_window = job.step, time.perf_counter()
        self.progress = TrainProgress(
            max_steps,
            enabled=info.is_main and job.show_progress,
            start=job.step,
            unit="token" if job.run.tokens_per_sample else "sample",
        )

    def start(self, heldout: dict[str, float]) -> None:
        """Before the first step: the evaluation at the start into the newest values and,
        on a fresh run, the run's start record."""
        job = self.job
        self.final.update(heldout)
        if job.step == 0 and not job.resumed:
            run_summary.record_start(
                job.out_dir, {k.removeprefix("heldout_"): v for k, v in heldout.items()}, job.info.is_main
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
        if heldout or (self.window and (step % self.job.cfg.train.log_every == 0 or step >= self.max_steps)):
            self.write(step, heldout)

    def write(self, step: int, heldout: dict[str, float]) -> None:
        """One metrics record (a collective: see the module)."""
        job, world = self.job, self.job.info.world_size
        keys = sorted(self.window)  # the same order on every rank
        totals = global_sum([v for k in keys for v in self.window[k]])
        record = {k: totals[2 * i] / totals[2 * i + 1] for i, k in enumerate(keys)}
        now = time.perf_counter()
        rate = (step - self.last_logged) * self.samples_per_step / max(now - self.t_window, 1e-9)
        record.update(
            step=step, lr=job.state.optimizer.param_groups[0]["lr"], world_size=world, samples_per_s=rate, **heldout
        )
        if job.run.tokens_per_sample:
            record["tokens_per_s"] = rate * job.run.tokens_per_sample
        self.window, self.last_logged, self.t_window = {}, step, now
        self.final.update({k: record[k] for k in keys})
        self.run_log.log(record, job.accumulator.last_grad_norm)
        JsonlWriter(job.out_dir / "metrics.jsonl").write(record)
        if job.info.is_main:  # the run's wall time counts the attempts' own (run_summary)
            run_summary.record_attempt_time(job.out_dir, self.run_log.attempt, now - self.t0)
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
