"""What a run records for people: per-rank step time and peak memory in each metrics
record, one line per attempt in `run_events.jsonl`, and TensorBoard event files.

`disttrain train` and `dt.Job` build one `RunLog` per attempt (a process-group
lifetime) and call `RunLog.log(record)` at their log steps. Files under `out_dir`:

    metrics.jsonl      one record per log step (the trainer's JSONL, rank 0); `log` adds
                       step_time_s and peak_mem_mb (one value per rank), their extremes,
                       grad_norm and the attempt number
    run_events.jsonl   one line per attempt: {"attempt", "step", "resumed", "world_size",
                       "prev_world_size", "torchelastic_restart", "time"}; attempt 0 is the
                       first start, every later line a restart (a new world size if it
                       differs from the previous line's)
    tb/                TensorBoard event files (`[log] tensorboard`), written by
                       `torch.utils.tensorboard.SummaryWriter`
    wandb/             W&B's own files (`[log] wandb`, train/trackers.py)

`disttrain report` reads the first two (it imports no torch).
"""

from __future__ import annotations

import atexit
import math
import os
import time
from pathlib import Path

import torch

from disttrain.errors import UserError
from disttrain.jsonl import read_jsonl
from disttrain.runtime import RankInfo
from disttrain.runtime.collectives import gather_floats
from disttrain.train.rank0_output import JsonlWriter

EVENTS = "run_events.jsonl"
TB_DIR = "tb"

# Record key -> TensorBoard tag. Keys not named here are written as "train/<key>".
_TAGS = {
    "loss": "loss/train",
    "heldout_loss": "loss/heldout",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "samples_per_s": "throughput/samples_per_s",
    "step_time_max_s": "step_time/slowest_rank_s",
    "step_time_min_s": "step_time/fastest_rank_s",
    "world_size": "run/world_size",
}
_NOT_SCALARS = {"step", "attempt", "step_time_s", "peak_mem_mb"}


def _tag(key: str) -> str:
    """A record key's TensorBoard tag: an evaluator's `<name>_loss` is `loss/<name>`."""
    if key in _TAGS:
        return _TAGS[key]
    return f"loss/{key[:-5]}" if key.endswith("_loss") else f"train/{key}"


def _event_text(event: dict) -> str:
    world, prev = event["world_size"], event["prev_world_size"]
    if event["attempt"] == 0:
        return f"start at step {event['step']} on {world} rank(s)"
    how = f"resumed at step {event['step']}" if event["resumed"] else "started again from step 0"
    change = f", world size {prev} -> {world}" if prev not in (None, world) else f" on {world} rank(s)"
    return f"restart (attempt {event['attempt']}): {how}{change}"


class RunLog:
    """One attempt's run record. Build it on every rank after the checkpoint load, with
    the step the attempt starts at and whether it resumed.

    Rank 0 appends this attempt's line to `run_events.jsonl` and, with `tensorboard`,
    opens a `SummaryWriter` on `out_dir/tb` that writes the start as the text summary
    `run/events` plus the scalars `run/attempt` and `run/world_size` at that step. A
    restart opens it with `purge_step` after the resumed step, so TensorBoard hides the
    steps the killed attempt logged after its checkpoint (they are trained again).
    `trackers` (rank 0's `train.trackers.Trackers`, or None) get the same start line and
    each record. Other ranks write nothing. An unwritable `out_dir` raises `OSError` on
    rank 0; a missing tensorboard package, a `UserError` there.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        info: RankInfo,
        step: int,
        resumed: bool,
        tensorboard: bool = True,
        trackers=None,
    ):
        self.info, self.clock, self.trackers = info, StepClock(step), trackers
        self.attempt, self.writer = 0, None
        if not info.is_main:
            return
        out = Path(out_dir)
        past = read_jsonl(out / EVENTS)
        self.attempt = len(past)
        self.event = {
            "attempt": self.attempt,
            "step": step,
            "resumed": resumed,
            "world_size": info.world_size,
            "prev_world_size": past[-1]["world_size"] if past else None,
            "torchelastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "time": time.time(),
        }
        JsonlWriter(out / EVENTS).write(self.event)
        if trackers is not None:  # W&B / MLflow (train/trackers.py)
            trackers.begin([_event_text(e) for e in [*past, self.event]], step)
        if tensorboard:
            # Imported here: only rank 0 of a run with TensorBoard on pays for it.
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch checks for the tensorboard package
                raise UserError(
                    f"TensorBoard logging needs the tensorboard package ({e}). Install it "
                    f"(pip install tensorboard), or turn it off with [log] tensorboard = "
                    f"false (dt.Job(..., tensorboard=False))."
                ) from None

            # Steps after `step` are trained again: hide what an earlier attempt logged for them.
            self.writer = SummaryWriter(str(out / TB_DIR), purge_step=step + 1 if past else None)
            self.writer.add_text("run/events", _event_text(self.event), step)
            self.writer.add_scalar("run/attempt", self.attempt, step)
            self.writer.add_scalar("run/world_size", info.world_size, step)
            self.writer.flush()
            atexit.register(self.close)  # the trainer returns without a close; flushes on exit

    def log(self, record: dict, grad_norm: float | torch.Tensor | None = None, samples_per_step: int = 0) -> dict:
        """Add this rank's and every other rank's wall time per step since the last call
        and peak memory (one all-gather), `grad_norm`, samples_per_s (`samples_per_step`
        over the slowest rank's step time, when given) and the attempt to `record`, write
        its numbers to TensorBoard on rank 0 (flushed, so a kill -9 keeps them) and
        return it. A collective: every rank calls it at the same steps. `record` needs
        "step"; NaN values are left out of TensorBoard."""
        step = int(record["step"])
        rows = gather_floats([self.clock.lap(step), peak_memory_mb(self.info.device)])
        times, memory = [r[0] for r in rows], [r[1] for r in rows]
        record.update(
            step_time_s=times,
            step_time_max_s=max(times),
            step_time_min_s=min(times),
            peak_mem_mb=memory,
            attempt=self.attempt,
        )
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if samples_per_step:
            record["samples_per_s"] = samples_per_step / max(max(times), 1e-9)
        if self.writer is not None:
            for key, value in record.items():
                if key in _NOT_SCALARS or not isinstance(value, (int, float)) or math.isnan(value):
                    continue
                self.writer.add_scalar(_tag(key), value, step)
            for rank, mb in enumerate(memory):
                self.writer.add_scalar(f"memory/peak_mb_rank{rank}", mb, step)
            self.writer.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        return record

    def close(self) -> None:
        """Flush and close the event file; safe to call twice."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory in MiB: `torch.cuda.max_memory_allocated` on a CUDA
    rank (tensors only), the peak resident set size of the process on a CPU rank."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class StepClock:
    """This rank's wall time per optimizer step between two `lap` calls. A window that
    holds an evaluation or a checkpoint save counts that time too."""

    def __init__(self, step: int):
        self.t, self.step = time.perf_counter(), step

    def lap(self, step: int) -> float:
        now = time.perf_counter()
        per_step = (now - self.t) / max(step - self.step, 1)
        self.t, self.step = now, step
        return per_step
