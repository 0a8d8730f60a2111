"""Where a `dt.Job` starts from: a survivor's memory (fast recovery), the newest valid
checkpoint (with the "checkpoint -> now" comparison of `train/resume.py`), or step 0.

A Job script's config, as stored and compared, is the job's settings and its
optimizer's hyper-parameters (`optim_config`): a script whose lr, weight decay, betas
or momentum changed since the checkpoint trains with the new values (the table says
so), as a `disttrain train` config does.
"""

from __future__ import annotations

from disttrain.errors import UserError
from disttrain.guard import path_nbytes
from disttrain.runtime.log import LOGGER
from disttrain.train import resume
from disttrain.train.saving import Saving

_OPTIM_KEYS = ("weight_decay", "betas", "momentum")


def optim_config(optimizer, scheduler) -> dict:
    """The optimizer's hyper-parameters as config keys (`optim.lr`, ...), from its first
    param group: the base LR when a scheduler moves it."""
    group = optimizer.param_groups[0]
    out: dict = {"lr": float(group.get("initial_lr", group["lr"]) if scheduler is not None else group["lr"])}
    for key in _OPTIM_KEYS:
        if key in group:
            value = group[key]
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def load(job, ckpt, acc) -> bool:
    """Fill `job.state` and return whether the run resumed; builds `job.saving`. A
    collective. Raises `CheckpointMismatch` for a changed model or data (a
    `disttrain train` config) before anything is loaded."""
    state, handoff = job.state, job.handoff
    optimizer, scheduler = state.optimizer, state.scheduler
    if job.run.stored_config is None:
        state.config = {**job.config(), "optim": optim_config(optimizer, scheduler)}
    else:
        state.config = job.run.stored_config
    plan = resume.inspect_root(job.checkpoint_dir, state.config) if job.cfg.checkpoint.enabled else None
    fresh = resume.fresh_hyperparams(optimizer, scheduler)
    in_memory = handoff is not None and handoff.gen > 0 and handoff.restore(state)
    loaded = None
    if job.cfg.checkpoint.enabled and not in_memory:
        with job.guard.slow_phase("checkpoint.load", nbytes=path_nbytes(job.checkpoint_dir)):
            loaded = ckpt.load(state)
    who = job.name
    if loaded is not None:
        if plan is None or plan.directory != str(loaded):  # the load fell back to another one
            plan = resume.plan_for(loaded, state.config)
            plan = plan.check() if plan is not None else None
        resume.apply(plan, optimizer, scheduler, fresh)  # before the batch policy scales the LR
    resumed = in_memory or loaded is not None
    job.resume_note, job.resume_plan = "", (plan if loaded is not None else None)
    if resumed:
        job.resume_note = _rejoin(job, who, state.step, acc)
    job.step, job.in_memory = (state.step if resumed else 0), in_memory
    job.saving = Saving(
        ckpt if job.cfg.checkpoint.enabled else None,
        state,
        job.guard,
        every=job.cfg.checkpoint.every,
        every_s=job.cfg.checkpoint.every_s,
        on_error=job.cfg.checkpoint.on_error,
        who=f"disttrain {who}",
    )
    if handoff is not None:  # from here this attempt's objects hold the state a recovery keeps
        handoff.keep(state=state, acc=acc)
        handoff.committed(acc.optimizer_steps, state, first=True)  # the buddy copy of the start
    return resumed


def say_resumed(job, max_steps: int) -> bool:
    """At the start of `job.steps`: for a run already at `max_steps`, one line that it is
    complete (and what a continued run would change); else the "resumed at" line and
    the table of applied changes. Returns whether there is anything to train."""
    who, plan = f"disttrain {job.name}", job.resume_plan
    if job.step >= max_steps:
        how = (
            resume.TRAIN_CONTINUES
            if job.name == "train"
            else f"nothing to train: raise max_steps ({max_steps}) to continue, or use another out_dir"
        )
        LOGGER.info(resume.complete_message(who, job.step, how, plan.changes if plan else ()))
        return False
    if job.resume_note:
        LOGGER.info(job.resume_note)
    resume.print_changes(who, plan, job.cfg.elastic.batch_policy)
    return True


def _rejoin(job, who: str, step: int, acc) -> str:
    """`resume.rejoin`, its batch-size refusal in the words of the way the run was
    started (a Job's keywords, or the TOML keys)."""
    state = job.state
    try:
        return resume.rejoin(
            who, step, acc, job.sampler, job.cfg.elastic.batch_policy, job.info, state.optimizer, state.scheduler
        )
    except UserError as e:
        if who != "job":
            raise
        text = (
            str(e)
            .replace("train.batch_size", "job.loader(batch_size=...)")
            .replace(
                "set elastic.batch_policy = 'rescale_lr'",
                "pass dt.Job(out_dir, config) with config.elastic.batch_policy='rescale_lr'",
            )
        )
        raise UserError(
            text + f" (the checkpoint in {job.checkpoint_dir} was written at another "
            f"world size; a new out_dir starts afresh)"
        ) from None
