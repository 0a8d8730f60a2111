"""The body of `dt.Job.steps()`: the one training loop of disttrain (a user's script and
`disttrain train` both run it).

Each part decides its own cadence: `Saving` when to checkpoint, the `Evaluator` when to
evaluate, the log window when to write a record, the preemption vote when to stop.
The loop reads top to bottom: seed, forward/backward in the user's code, commit,
then each part's `after_step`.

A non-finite loss (or weights) stops the run before the next save, on every rank, with
one line naming the step: a diverged state is never checkpointed over good ones.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from disttrain import runtime, worker_notes
from disttrain.checkpoint import save_model
from disttrain.checkpoint.finite import first_non_finite
from disttrain.elastic import SampleAudit, generation_id
from disttrain.errors import UserError
from disttrain.parallel import unwrap
from disttrain.runtime.collectives import comm_device
from disttrain.runtime.fault_injection import inject
from disttrain.train import job_resume, run_summary
from disttrain.runtime.log import LOGGER
from disttrain.train.metrics import JsonlWriter, global_sum
from disttrain.train.progress import TrainProgress
from disttrain.train.run_log import RunLog
from disttrain.train.trackers import open_trackers
from disttrain.train.sources import to_device


class Loop:
    """One attempt's loop state: the log window, the last metrics, the audit, the run
    log and the progress bar (see `run`)."""

    def __init__(self, job, max_steps: int):
        self.job, self.max_steps, info = job, max_steps, job.info
        self.window: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.bad_step: int | None = None
        self.t0 = time.perf_counter()
        self.samples_per_step = job._loader.batch_size * job._acc.accum_steps * info.world_size
        self.audit = SampleAudit(job.out_dir / "samples", info.rank, info.world_size,
                                 job.record_samples, generation_id())
        self.trackers = open_trackers(job.trackers, job.checkpoint_dir, job.out_dir, job.config()) \
            if info.is_main else None
        self.run_log = RunLog(job.out_dir, info, job.step, job.resumed, job.tensorboard, self.trackers)
        self.last_logged, self.t_window = job.step, time.perf_counter()
        self.progress = TrainProgress(max_steps, enabled=info.is_main and job.show_progress,
                                      start=job.step, unit="token" if job.tokens_per_sample else "sample")
        job._saving.check = self.check_finite

    # -------------------------------------------------------------- values

    def watch_loss(self, loss: torch.Tensor) -> None:
        """The first step whose loss is not finite (checked before the next save)."""
        if self.bad_step is None and isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            self.bad_step = self.job.step + 1

    def log(self, values: dict) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UserError(f"dt.Job.log({key}=...) got {type(value).__name__}; pass a number "
                                f"or a one-element tensor, e.g. job.log(loss=loss).")
            acc = self.window.setdefault(key, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + float(value), acc[1] + 1.0

    def check_finite(self, step: int) -> None:
        """A collective before each save: raise `UserError` on every rank when any rank
        saw a non-finite loss or holds non-finite weights."""
        bad = self.bad_step
        if bad is None and first_non_finite(self.job.model) is not None:  # this rank's shards
            bad = step
        first = torch.tensor([float(bad) if bad is not None else math.inf], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            first = first.to(comm_device())
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if math.isfinite(float(first.item())):
            raise UserError(f"training diverged: the loss or the weights became non-finite (nan/inf) "
                            f"at step {int(first.item())}; stopped before saving it (the newest "
                            f"checkpoint is step {self.job._saving.saved_at}). Lower the learning rate, "
                            f"clip gradients, or check the data.")

    # -------------------------------------------------------------- per step

    def start(self) -> None:
        """Before the first step: the evaluation at the start (not after an in-memory
        recovery, which does not wait for it) and the run's start record."""
        job = self.job
        job._saving.start(job.step)
        heldout = {}
        for ev in job._evaluators:
            if ev.at_start and not job.in_memory:
                heldout.update(self._evaluate(ev))
        if job.step == 0 and not job.resumed:
            run_summary.record_start(job.out_dir, {k.removeprefix("heldout_"): v for k, v in heldout.items()},
                                     job.info.is_main)

    def after_step(self) -> bool:
        """A committed optimizer step: commit the sampler and audit, then evaluation, the
        record, the stop vote and the save, each at its own cadence. True: stop here."""
        job = self.job
        self.commit()
        if job._handoff is not None:
            job._handoff.committed(job.step, job._state)
        inject("step", job.step, job.info.rank)
        job._guard.step(job.step, job.model)
        self.progress.advance(job.step)
        heldout = {}
        for ev in job._evaluators:
            if ev.due(job.step, self.max_steps) and job._preempt.time_for(ev.seconds):
                heldout.update(self._evaluate(ev))  # skipped when a SIGTERM's grace no longer fits it
        if heldout or (self.window and (job.step % job.log_every == 0 or job.step >= self.max_steps)):
            self._write(heldout)
        stopping = job._preempt.should_stop()  # agreed by all ranks (one all-reduce)
        job._saving.after_step(job.step, stopping)
        return stopping

    def commit(self) -> None:
        """The optimizer step just taken, in the job's counters: its number, the sampler's
        cursor and the audit. No collective: it also runs when the loop is left right
        after the step (`take_left_step`)."""
        job = self.job
        job.step = job._acc.optimizer_steps
        job._sampler.commit_step()
        self.audit.commit(job.step)

    def take_left_step(self) -> None:
        """The script left the loop (`break`, `return`, an exception) after the backward
        that stepped the optimizer: count that step, as plain PyTorch keeps an
        `optimizer.step()` before a `break`. Evaluation, records and saves wait for the
        next loop or the script's own save."""
        self.take_batch()
        self.commit()

    def take_batch(self) -> None:
        """The batch just trained on: its sample indices into the audit, which records
        them with the step they belong to (`commit`)."""
        loader = self.job._loader
        self.audit.add(torch.tensor(loader.sampler.take(loader.batch_size)))

    def _evaluate(self, ev) -> dict[str, float]:
        job = self.job
        with job._guard.slow_phase("eval", nbytes=ev.slow_nbytes(job.model)):
            result = {f"{ev.name}_{k}": v for k, v in ev.run(job.model).items()}
        self.final.update(result)
        return result

    def _write(self, heldout: dict[str, float]) -> None:
        """One metrics record (a collective: see `Job.log`)."""
        job, world = self.job, self.job.info.world_size
        keys = sorted(self.window)  # the same order on every rank
        totals = global_sum([v for k in keys for v in self.window[k]])
        record = {k: totals[2 * i] / totals[2 * i + 1] for i, k in enumerate(keys)}
        now = time.perf_counter()
        rate = (job.step - self.last_logged) * self.samples_per_step / max(now - self.t_window, 1e-9)
        record.update(step=job.step, lr=job._state.optimizer.param_groups[0]["lr"], world_size=world,
                      samples_per_s=rate, **heldout)
        if job.tokens_per_sample:
            record["tokens_per_s"] = rate * job.tokens_per_sample
        self.window, self.last_logged, self.t_window = {}, job.step, now
        self.final.update({k: record[k] for k in keys})
        self.run_log.log(record, job._acc.last_grad_norm)
        JsonlWriter(job.out_dir / "metrics.jsonl").write(record)
        self.progress.update(job.step, self.final.get("loss", float("nan")),
                             self.final.get("heldout_loss", float("nan")),
                             record.get("tokens_per_s", rate))

    def finish(self, stopping: bool) -> None:
        """The final save, then either the preemption's exit or model.pt and the summary."""
        job = self.job
        job._saving.finish(job.step)
        self.progress.close()
        job._guard.close()
        if self.trackers is not None:
            self.trackers.close()  # a preempted run continues the same tracker run when resumed
        if stopping:
            job.preempted = True
            if job._saving.ckpt is not None and job._saving.saved_at == job.step:
                worker_notes.note_saved(job.info.rank, job.step)  # the launcher says "saved"
            LOGGER.info(f"disttrain {job.name}: preempted ({job._preempt.signal_name}); saved step "
                       f"{job.step} and stopped. Start the same command again to resume.")
            if job.exit_on_preempt:
                raise SystemExit(0)
            return
        if job._saving.checked_at != job.step:
            self.check_finite(job.step)
        # An adapter (HFCausalLM) saves its inner model's own keys: model.pt loads strict there.
        prefix = getattr(unwrap(job.model), "export_prefix", "")
        path = save_model(job.model, job.out_dir / "model.pt", strip=prefix)
        job.summary = run_summary.build(
            job.out_dir, steps=job.step, world_size=job.info.world_size, strategy=job.strategy,
            attempt_t0=self.t0, samples_per_step=self.samples_per_step,
            tokens_per_sample=job.tokens_per_sample, final=self.final, resumed=job.resumed,
            extra={"checkpoint": str(path), **job.summary_extra},
            eval_names=tuple(ev.name for ev in job._evaluators))
        if job.info.is_main:
            run_summary.write(job.out_dir, job.summary, job.summary_config or job.config())


def run(job, max_steps: int) -> Iterator[Any]:
    """The generator `Job.steps` returns (see there)."""
    if not job_resume.say_resumed(job, max_steps):  # complete already: says so, trains nothing
        return
    loop = job._loop = Loop(job, max_steps)
    loop.start()
    acc, guard, rank, stopping = job._acc, job._guard, job.info.rank, False
    while job.step < max_steps and not stopping:
        for batch in job._loader:  # each pass is a new epoch: the sampler advances itself
            guard.first_batch(batch)
            if acc.window_start:  # dropout from (seed, step, rank): exact resume
                runtime.seed_step(job.step)
            inject("forward", job.step + 1, rank)
            with acc.micro_step():
                job._in_step, job._backward_done = True, False
                job._owner.before_user()
                try:
                    yield to_device(batch, job.info.device)
                except GeneratorExit:  # the script left the loop
                    job._owner.left_loop()
                    if acc.stepped:
                        loop.take_left_step()
                    raise
                finally:
                    job._in_step = False
                job._owner.after_user()
                if not job._backward_done:
                    raise UserError("each batch from job.steps() needs one job.backward(loss) "
                                    "before the next; this one had none (a script's own "
                                    "loss.backward() does not count: call job.backward(loss)).")
            loop.take_batch()
            if acc.stepped:
                stopping = loop.after_step()
                if stopping or job.step >= max_steps:
                    break
    loop.finish(stopping)
