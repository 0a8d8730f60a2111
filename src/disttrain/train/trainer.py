"""The per-rank job of `disttrain train`: the TOML's model, data, optimizer and schedule
driving a `dt.Job` (train/job.py), the one training loop of disttrain. Everything a run
does around the step (resume, checkpoints, evaluation, preemption, fast recovery, the
guard, the logs and the summary) is the Job's.

`disttrain.launch.train_command` validates the config and starts this on every rank
(`python -m disttrain.train`); a config error never starts a process.
"""

from __future__ import annotations

from pathlib import Path

from disttrain.config import Config, to_dict
from disttrain.elastic import fast_recovery
from disttrain.parallel.optimizers import build_optimizer
from disttrain.parallel.precision import make_grad_scaler
from disttrain.runtime.log import LOGGER
from disttrain.train import model_data_loss, resume_plan, run_summary, spare_rehearsal
from disttrain.train.accumulation import warmup_cosine
from disttrain.train.batches import batch_loss
from disttrain.train.evaluation import loss_metric
from disttrain.train.job import Job
from disttrain.train.job_config import RunOptions


def train(cfg: Config, config_dir: str | Path | None = None, inspected: resume_plan.Inspected | None = None) -> dict:
    """Run one training job in this process (one rank). Returns the summary dict.

    The model, data and loss come from `disttrain.train.model_data_loss`: the built-in GPT on
    the stdlib corpus, or the config's model.factory / data.factory / train.loss,
    imported from `config_dir` (the config file's folder; None: sys.path only).
    Resumes from the newest valid checkpoint when there is one (no flag). On SIGTERM
    every rank stops after the same step, saves, and returns with
    `summary["preempted"]` True. Under `[elastic] fast_recovery` (a child of the slot
    supervisor) each generation of the in-memory recovery runs it again.
    `inspected`: the launcher's `resume_plan.inspect` of this config (`train.launcher_findings`),
    used instead of reading the checkpoint again, in the first generation only.
    """
    p, t = cfg.parallel, cfg.train
    if fast_recovery.enabled():
        return fast_recovery.run(
            lambda info, handoff: _train(cfg, config_dir, handoff, inspected if handoff.gen == 0 else None),
            backend=p.backend,
            device=p.device,
            timeout_s=p.timeout_s,
            seed=t.seed,
            prepare=lambda h: _datasets(cfg, config_dir, h),
            standby=lambda h: _rehearse(cfg, config_dir, h),
        )
    return _train(cfg, config_dir, None, inspected)


def _rehearse(cfg: Config, config_dir, handoff: fast_recovery.Handoff) -> None:
    """A standing-by spare rehearses its first sharded step at the place it will likely
    take (`train.spare_rehearsal`)."""
    rank, world = fast_recovery.place_to_join(handoff)
    took = spare_rehearsal.rehearse(cfg, lambda: model_data_loss.build_model(cfg, config_dir), rank, world)
    if took is not None:
        LOGGER.debug(f"disttrain: the spare rehearsed a sharded step as rank {rank} of {world} in {took:.2f} s")


def _datasets(cfg: Config, config_dir, handoff):
    """`model_data_loss.build_datasets`, kept across the attempts of a fast recovery (a spare
    builds them while it waits)."""
    if handoff is None:
        return model_data_loss.build_datasets(cfg, config_dir)
    return handoff.cached("datasets", lambda: model_data_loss.build_datasets(cfg, config_dir))


def job_for(cfg: Config, dataset_len: int, data_info: dict) -> Job:
    """The `Job` a config describes: the Config itself (its [parallel], [train],
    [optim], [checkpoint], [elastic], [guard] and [log] sections), and what only this
    adapter adds (`RunOptions`: the stored config, the summary, tokens, no exit)."""
    tokens = 0 if (cfg.data.factory or cfg.data.hf_dataset) else model_data_loss.window(cfg)
    unit = "token" if tokens else "sample"
    return Job(
        cfg.train.out_dir,
        cfg,
        run=RunOptions(
            stored_config=to_dict(cfg),
            guard_fields={"dataset_len": dataset_len},
            summary_config=run_summary.applicable_config(cfg),
            exit_on_preempt=False,
            tokens_per_sample=tokens,
            summary_extra={**data_info, "unit": unit, "loss_unit": loss_unit(cfg)},
        ),
    )


def loss_unit(cfg: Config) -> str:
    """What a loss is measured in, from the data: nats per byte on the byte corpus, per
    token on token files and a Hugging Face dataset; '' for a data.factory's (unknown)."""
    d = cfg.data
    if d.factory:
        return ""
    return "nats/token" if (d.tokens or d.hf_dataset) else "nats/byte"


def _train(cfg: Config, config_dir, handoff, inspected: resume_plan.Inspected | None = None) -> dict:
    t, d = cfg.train, cfg.data
    # The built-in GPT on the stdlib corpus, or the config's own (train/model_data_loss.py).
    train_set, heldout_set, data_info = _datasets(cfg, config_dir, handoff)
    loss_fn = model_data_loss.build_loss(cfg, config_dir)
    with job_for(cfg, len(train_set), data_info) as job:
        # The newest checkpoint's config against this one: a changed model or dataset is
        # refused before anything is built; a finished run is left as it is.
        plan = resume_plan.inspect_once(cfg, inspected)
        if plan is not None and plan.step >= t.steps:
            LOGGER.info(resume_plan.train_complete_message(plan))
            return {"steps": plan.step, "world_size": job.info.world_size, "complete": True, "preempted": False}
        raw = model_data_loss.build_model(cfg, config_dir)
        model = job.wrap(raw)  # bf16/fp16 (P-DDP-7, P-FSDP-5)
        optimizer = build_optimizer(model, cfg)  # after wrap (P-DDP-3)
        scheduler = warmup_cosine(
            optimizer, total_steps=t.steps, warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio
        )
        loader = job.loader(
            train_set,
            t.batch_size,
            drop_last=d.drop_last,
            num_workers=d.num_workers,
            pin_memory=d.pin_memory,
            persistent_workers=d.persistent_workers,
        )
        if heldout_set is not None:
            job.evaluator(
                heldout_set,
                t.batch_size,
                every=t.eval_every,
                max_batches=t.eval_batches,
                metric=loss_metric(loss_fn),
                at_start=True,
            )
        job.resume(model=model, optimizer=optimizer, scheduler=scheduler, scaler=make_grad_scaler(t.precision))
        first, data_key = True, model_data_loss.data_key(cfg)
        for batch in job.steps(loader, t.steps):
            # model(**dict), model(*tuple) or model(batch); its loss, or train.loss
            loss = batch_loss(model, batch, loss_fn, first=first, data=data_key)
            first = False
            job.backward(loss)
            job.log(loss=loss)
        if job.preempted:
            return {"steps": job.step, "preempted": True, "world_size": job.info.world_size}
        assert job.summary is not None  # set by the loop's end
        return job.summary
