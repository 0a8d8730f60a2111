"""Where a `dt.Job` starts from: a survivor's memory (fast recovery), the newest valid
checkpoint (with the "checkpoint -> now" comparison of `train/resume_plan.py`), or step 0.

A Job script's config, as stored and compared, is the job's settings and its
optimizer's hyper-parameters (`optim_config`): a script whose lr, weight decay, betas
or momentum changed since the checkpoint trains with the new values (the table says
so), as a `disttrain train` config does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from disttrain.errors import UserError
from disttrain.guard import path_nbytes
from disttrain.runtime.log import LOGGER
from disttrain.train import resume_plan

if TYPE_CHECKING:
    from disttrain.checkpoint import Checkpointer, TrainState
    from disttrain.data import ElasticSampler
    from disttrain.elastic.fast_recovery import Handoff
    from disttrain.guard import RunGuard
    from disttrain.train.accumulation import Accumulator

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


@dataclass(frozen=True)
class ResumeInputs:
    """What a resume reads of the job that asks for it."""

    name: str
    """How the job speaks: 'job' (a script's `dt.Job`) or 'train' (`disttrain train`)."""
    state: TrainState
    config: dict
    """What the checkpoints store as the run's config: the adapter's whole config, or
    the job's settings (the optimizer's hyper-parameters are added here)."""
    whole_config: bool
    """`config` is an adapter's (`disttrain train`'s TOML): stored as it is."""
    checkpoint_dir: Path
    batch_policy: str
    sampler: ElasticSampler
    data_parallel: tuple[int, int]
    """(rank, size) over the data-parallel ranks (a tensor-parallel group is one)."""
    guard: RunGuard
    handoff: Handoff | None


@dataclass(frozen=True)
class Resumed:
    """Where the job starts: `step` (0: a fresh start), from a survivor's memory or a
    checkpoint, the "resumed at" line and the checkpoint's plan of changes."""

    resumed: bool = False
    step: int = 0
    in_memory: bool = False
    note: str = ""
    plan: resume_plan.ResumePlan | None = None


def load(inputs: ResumeInputs, ckpt: Checkpointer | None, acc: Accumulator) -> Resumed:
    """Fill `inputs.state` from a survivor's memory or the newest valid checkpoint in
    `ckpt`'s root (None: checkpoints are off), and say where the job starts. A collective.
    Raises `CheckpointMismatch` for a changed model or data (a `disttrain train` config)
    before anything is loaded."""
    state, handoff = inputs.state, inputs.handoff
    optimizer, scheduler = state.optimizer, state.scheduler
    assert optimizer is not None  # Job.resume() builds the state with the script's optimizer
    state.config = (
        inputs.config if inputs.whole_config else {**inputs.config, "optim": optim_config(optimizer, scheduler)}
    )
    plan = resume_plan.inspect_root(inputs.checkpoint_dir, state.config) if ckpt is not None else None
    fresh = resume_plan.fresh_hyperparams(optimizer, scheduler)
    in_memory = handoff is not None and handoff.gen > 0 and handoff.restore(state)
    loaded = None
    if ckpt is not None and not in_memory:
        with inputs.guard.slow_phase("checkpoint.load", nbytes=path_nbytes(inputs.checkpoint_dir)):
            loaded = ckpt.load(state)
    if loaded is not None:
        if plan is None or plan.directory != str(loaded):  # the load fell back to another one
            plan = resume_plan.plan_for(loaded, state.config)
            plan = plan.check() if plan is not None else None
        resume_plan.apply(plan, optimizer, scheduler, fresh)  # before the batch policy scales the LR
    if handoff is not None:  # from here this attempt's objects hold the state a recovery keeps
        handoff.keep(state=state, acc=acc)
        handoff.committed(acc.optimizer_steps, state, first=True)  # the buddy copy of the start
    if not (in_memory or loaded is not None):
        return Resumed()
    note = _rejoin(inputs, state.step, acc)
    return Resumed(True, state.step, in_memory, note, plan if loaded is not None else None)


def say_resumed(name: str, step: int, max_steps: int, start: Resumed, batch_policy: str) -> bool:
    """At the start of `job.steps`: for a run already at `max_steps`, one line that it is
    complete (and what a continued run would change); else the "resumed at" line and
    the table of applied changes. Returns whether there is anything to train."""
    who, plan = f"disttrain {name}", start.plan
    if step >= max_steps:
        how = (
            resume_plan.TRAIN_CONTINUES
            if name == "train"
            else f"nothing to train: raise max_steps ({max_steps}) to continue, or use another out_dir"
        )
        LOGGER.info(resume_plan.complete_message(who, step, how, plan.changes if plan else ()))
        return False
    if start.note:
        LOGGER.info(start.note)
    resume_plan.print_changes(who, plan, batch_policy)
    return True


def _rejoin(inputs: ResumeInputs, step: int, acc: Accumulator) -> str:
    """`resume_plan.rejoin`, its batch-size refusal in the words of the way the run was
    started (a Job's keywords, or the TOML keys)."""
    state = inputs.state
    try:
        return resume_plan.rejoin(
            inputs.name,
            step,
            acc,
            inputs.sampler,
            inputs.batch_policy,
            inputs.data_parallel,
            state.optimizer,
            state.scheduler,
        )
    except UserError as e:
        if inputs.name != "job":
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
            text + f" (the checkpoint in {inputs.checkpoint_dir} was written at another "
            f"world size; a new out_dir starts afresh)"
        ) from None
