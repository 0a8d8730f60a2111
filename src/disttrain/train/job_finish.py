"""The end of `dt.Job.steps()`: the final save, then either the preemption's exit or
`model.pt` and `summary.json`."""

from __future__ import annotations

from disttrain import worker_notes
from disttrain.checkpoint import save_model
from disttrain.parallel import unwrap
from disttrain.runtime.log import LOGGER
from disttrain.train import run_summary


def finish(job, stopping: bool) -> None:
    """After the loop (`stopping`: the ranks agreed to stop on a preemption signal).
    Preempted: `job.preempted`, the launcher's "saved" note, and `SystemExit(0)` when
    `exit_on_preempt`. Otherwise the finite check (when the final save did not run it),
    the prefix-free `model.pt` and `job.summary` (rank 0 writes `summary.json`)."""
    metrics = job.metrics
    job.saving.finish(job.step)
    metrics.close()
    job.guard.close()
    if stopping:
        job.preempted = True
        if job.saving.ckpt is not None and job.saving.saved_at == job.step:
            worker_notes.note_saved(job.info.rank, job.step)  # the launcher says "saved"
        LOGGER.info(
            f"disttrain {job.name}: preempted ({job.preemption.signal_name}); saved step "
            f"{job.step} and stopped. Start the same command again to resume."
        )
        if job.run.exit_on_preempt:
            raise SystemExit(0)
        return
    if job.saving.checked_at != job.step:
        job.finite_check.check(job.step)
    # An adapter (HFCausalLM) saves its inner model's own keys: model.pt loads strict there.
    prefix = getattr(unwrap(job.model), "export_prefix", "")
    path = save_model(job.model, job.out_dir / "model.pt", strip=prefix)
    job.summary = run_summary.build(
        job.out_dir,
        steps=job.step,
        world_size=job.info.world_size,
        strategy=job.strategy,
        attempt_t0=metrics.t0,
        samples_per_step=metrics.samples_per_step,
        tokens_per_sample=job.run.tokens_per_sample,
        final=metrics.final,
        resumed=job.resumed,
        extra={"checkpoint": str(path), **job.run.summary_extra},
        eval_names=tuple(ev.name for ev in job.evaluators),
        attempt=metrics.run_log.attempt,
    )
    if job.info.is_main:
        run_summary.write(job.out_dir, job.summary, job.run.summary_config or job.config())
