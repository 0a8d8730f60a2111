"""Resuming with a changed config: what may differ from the checkpoint's config (docs/resume.md).

Every checkpoint stores the resolved config of the run that wrote it (`TrainState.config`,
the "config" of its `state.json`; the manifest keeps its hash). `disttrain train` compares
it with this run's config, key by key, in three classes:

- refused: the run's identity (`identity_of`: every model.* key but model.dropout, the
  data.* keys that choose the training samples, optim.name, train.seed, train.loss; the
  kwargs tables are compared whole, `WHOLE`): the weights or the sample order would not
  be the run's any more. `inspect` raises `CheckpointMismatch` listing each key as
  `key: checkpoint -> now` and what it changes, before anything is built or written.
- applied (every other optim.* key, and `APPLIED`): after the load, `apply` writes the new
  optimizer hyper-parameters into the param groups and the scheduler, and rank 0 prints a
  "checkpoint -> now" table. Batch size and accumulation follow elastic.batch_policy.
- ignored (everything else: parallel, guard, checkpoint, elastic, logging, out_dir, the
  loader knobs data.num_workers, pin_memory and persistent_workers, train.compile, the
  cadences): how this run runs, not what it trains; they take effect as set and are not
  reported.

A key that only one of the two configs has (a checkpoint of another disttrain version)
is not compared. A path key is compared as a place (`path_keys.same_place`): a checkpoint
of an earlier version stored it relative to the config file's folder, this run absolute.
A checkpoint without a stored config is resumed as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain import json_text
from disttrain.checkpoint import CheckpointCorrupt, CheckpointMismatch
from disttrain.checkpoint.own_files import escapes, read_own
from disttrain.checkpoint.step_folders import committed
from disttrain.config import Config, to_dict
from disttrain.config.path_keys import same_place
from disttrain.elastic import apply_batch_policy
from disttrain.runtime.collectives import broadcast_json, conform

_WEIGHTS = "the model, which the saved weights fit"
_SAMPLES = "the training samples, which the saved sample cursor counts through"
IDENTITY = {
    "optim.name": "the optimizer, whose state the checkpoint holds",
    "train.seed": "the epoch order, which the saved sample cursor counts through",
    "train.loss": "the objective the saved weights were trained for",
    "data.drop_last": "the length of an epoch, which the saved sample cursor counts through",
    **{
        f"data.{k}": _SAMPLES
        for k in (
            "factory",
            "kwargs",
            "corpus",
            "max_bytes",
            "heldout_fraction",
            "tokens",
            "tokens_heldout",
            "tokens_dtype",
            "hf_dataset",
            "hf_columns",
            "hf_split",
            "block_size",
        )
    },
}
"""The run's identity besides model.* (model.factory, model.kwargs and the hf keys
included): key -> what a change of it changes. A data.* key that is in neither this
table nor `NOT_IDENTITY` counts as identity too (it may change the samples)."""
NOT_IDENTITY = frozenset({"data.num_workers", "data.pin_memory", "data.persistent_workers", "data.hf_heldout_split"})
"""data.* keys that change how samples are loaded, or only the held-out set, not which
samples train in which order: ignored like the performance knobs and cadences."""
WHOLE = frozenset({"model.kwargs", "data.kwargs", "model.hf_config"})
"""Tables compared as one value: a key added to or dropped from them is a change too."""
APPLIED = frozenset(
    {"model.dropout", "train.steps", "train.batch_size", "train.accum_steps", "train.precision", "train.fp8_recipe"}
)
"""Applied besides optim.*: read from this run's config when the run is built."""
SCHEDULE = frozenset({"optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "train.steps"})
"""Keys that move the learning rate at the resumed step."""
GROUP_KEYS = {"optim.weight_decay": "weight_decay", "optim.betas": "betas", "optim.momentum": "momentum"}
"""Config key -> the param-group key that holds it."""


def classify(key: str) -> str:
    """'refuse', 'apply' or 'ignore' for a dotted config key."""
    if key in APPLIED:
        return "apply"
    if identity_of(key) is not None:
        return "refuse"
    return "apply" if key.startswith("optim.") else "ignore"


def identity_of(key: str) -> str | None:
    """What a change of `key` changes when the key is part of the run's identity (the
    refusal says it), else None."""
    if key in IDENTITY:
        return IDENTITY[key]
    if key.startswith("model.") and key not in APPLIED:
        return _WEIGHTS
    if key.startswith("data.") and key not in NOT_IDENTITY:
        return "the training data"
    return None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in WHOLE:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


@dataclass
class ResumePlan:
    """The checkpoint a run resumes from and how its config differs from this run's.

    `changes` holds (key, checkpoint value, this run's value) for every applied key
    that differs; `refused` the same for refused keys (non-empty only before `check`).
    """

    directory: str
    step: int
    saved_config: dict | None
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    refused: list[tuple[str, Any, Any]] = field(default_factory=list)

    def check(self) -> ResumePlan:
        """Raise `CheckpointMismatch` (one line) when a refused key differs; else self."""
        if self.refused:
            listing = "; ".join(f"{k}: {_fmt(a)} -> {_fmt(b)} changes {identity_of(k)}" for k, a, b in self.refused)
            path = Path(self.directory)
            raise CheckpointMismatch(
                f"the checkpoint {path.name} in {path.parent} belongs to another run ({listing}). "
                f"A checkpoint resumes only the run that wrote it: use another --train.out_dir (or "
                f"checkpoint.dir) to start a new run, or set these keys back to the checkpoint's "
                f"values to resume it."
            )
        return self

    def to_json(self) -> dict:
        """Plain JSON values (the rows become lists); `from_json` is the inverse."""
        return asdict(self)

    @staticmethod
    def from_json(data: Any, who: str) -> ResumePlan:
        """The plan of `to_json`'s `data`, which `who` sent, every field checked
        (`conform`). Raises `MalformedPeerValue` for anything else: a peer's or a
        handed file's value is data, never code."""
        fields = conform(data, _PLAN_SHAPE, f"{who} (its resume plan)")
        return ResumePlan(**fields)


_ROWS = list[tuple[str, Any, Any]]
_PLAN_SHAPE = {"directory": str, "step": int, "saved_config": dict[str, Any] | None, "changes": _ROWS, "refused": _ROWS}
"""A resume plan as JSON: each field of `ResumePlan` with its type (a row is a list)."""


def plan_for(directory: str | Path, cfg: Config | dict) -> ResumePlan | None:
    """Read `directory/state.json` (plain JSON, nothing unpickled; `own_files.read_own`:
    a regular file within a bound, no symlink followed) and compare its config with
    `cfg` (a `Config`, or the dict a `dt.Job` stores). None when the file is missing,
    unreadable or refused (a symlink, a FIFO, ...: the load reports that)."""
    if escapes(Path(directory), "state.json"):
        return None
    try:
        meta = json_text.loads(read_own(Path(directory), "state.json"))
        step, saved = int(meta["step"]), meta.get("config")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, CheckpointCorrupt):
        return None  # the load that follows reads it again and names what is wrong
    plan = ResumePlan(str(directory), step, saved if isinstance(saved, dict) else None)
    if plan.saved_config is None:
        return plan
    old = _flatten(plan.saved_config)
    now = _flatten(json.loads(json.dumps(cfg if isinstance(cfg, dict) else to_dict(cfg))))  # as stored
    for key in sorted(old.keys() & now.keys()):
        if not same_place(key, old[key], now[key]) and (kind := classify(key)) != "ignore":
            (plan.refused if kind == "refuse" else plan.changes).append((key, old[key], now[key]))
    return plan


def checkpoint_root(cfg: Config) -> Path:
    """Where the run's checkpoints live: checkpoint.dir, or {train.out_dir}/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.out_dir) / "checkpoints"


def inspect(cfg: Config) -> ResumePlan | None:
    """`inspect_root` for a `disttrain train` config: None with checkpoints disabled."""
    return inspect_root(checkpoint_root(cfg), cfg) if cfg.checkpoint.enabled else None


def inspect_root(root: str | Path, cfg: Config | dict) -> ResumePlan | None:
    """The plan for the newest committed checkpoint under `root`, the same on every rank
    (rank 0 reads, one broadcast): None on a fresh start. A collective.

    Raises `CheckpointMismatch` on every rank when a refused key differs. Reads only;
    the load later verifies the checkpoint's checksums.
    """
    plan = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        newest = committed(Path(root))
        plan = plan_for(newest[0][2], cfg) if newest else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        sent = broadcast_json(plan.to_json() if plan is not None else None, src=0)
        plan = ResumePlan.from_json(sent, "rank 0") if sent is not None else None
    return plan.check() if plan is not None else None


@dataclass(frozen=True)
class Inspected:
    """The result of `inspect` done elsewhere (the launcher of `disttrain train`), handed
    to a rank so that it does not read the checkpoint again: `plan` is None for a fresh
    start. Distinct from None, which means "not inspected yet"."""

    plan: ResumePlan | None

    def to_json(self) -> dict | None:
        """Plain data for the launcher's handed file (`train.launched`)."""
        return None if self.plan is None else self.plan.to_json()

    @staticmethod
    def from_json(data: dict | None) -> Inspected:
        """The inverse of `to_json` (JSON's lists turned back into the plan's tuples).
        Raises `MalformedPeerValue` for data that is not a plan (`ResumePlan.from_json`)."""
        return Inspected(None if data is None else ResumePlan.from_json(data, "the launcher"))


def inspect_once(cfg: Config, inspected: Inspected | None) -> ResumePlan | None:
    """The handed plan when there is one, else `inspect(cfg)` (a collective then). A
    handed plan has passed `ResumePlan.check` where it was made."""
    return inspected.plan if inspected is not None else inspect(cfg)


TRAIN_CONTINUES = "raise --train.steps to continue, or use another --train.out_dir"
"""How a finished `disttrain train` run is continued (or left alone)."""


def complete_message(who: str, step: int, how: str, changes=()) -> str:
    """The one line of a run whose checkpoint is at its last step: that it is complete,
    `how` to continue, and the `changes` since the checkpoint ((key, checkpoint value,
    this run's value), as `ResumePlan.changes`) that a continued run would apply."""
    text = f"{who}: complete at step {step}; {how}."
    if changes:
        text += (
            " Continued, it would apply the changes since the checkpoint: "
            + ", ".join(f"{key} {_fmt(old)} -> {_fmt(new)}" for key, old, new in changes)
            + "."
        )
    return text


def train_complete_message(plan: ResumePlan) -> str:
    """`complete_message` for a `disttrain train` config whose checkpoint is at train.steps."""
    return complete_message("disttrain train", plan.step, TRAIN_CONTINUES, plan.changes)


def fresh_hyperparams(optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """This run's optimizer settings, taken before a load overwrites them with the
    checkpoint's: each param group's values (no params) and the scheduler's base LRs."""
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "base_lrs": list(scheduler.base_lrs) if scheduler is not None else None,
    }


def apply(plan: ResumePlan | None, optimizer: torch.optim.Optimizer, scheduler, fresh: dict) -> None:
    """Write this run's hyper-parameters over the loaded ones, for each key in `plan.changes`.

    optim.lr: the scheduler's base LRs (and each group's initial_lr) become this run's,
    times any factor the checkpoint's base LRs carried over its configured lr (a
    rescale_lr resume); weight_decay, betas, momentum: the values `build_optimizer` gave
    each group; a schedule key (lr, warmup, min_lr_ratio, train.steps): the current LR
    becomes base LR x this run's schedule at the resumed step, as a run started with
    this config would have it. Other applied keys are read from the config already.
    """
    if plan is None or not plan.changes:
        return
    changed = {key for key, _, _ in plan.changes}
    groups = optimizer.param_groups
    for key, group_key in GROUP_KEYS.items():
        if key in changed:
            for group, new in zip(groups, fresh["groups"], strict=False):
                if group_key in new:
                    group[group_key] = new[group_key]
    if scheduler is None or not changed & SCHEDULE:
        if "optim.lr" in changed:  # no scheduler: the lr is the group's own
            for group, new in zip(groups, fresh["groups"], strict=False):
                group["lr"] = new["lr"]
        return
    if "optim.lr" in changed:
        factor = _carried_factor(plan.saved_config, scheduler.base_lrs)
        scheduler.base_lrs = [new * f for new, f in zip(fresh["base_lrs"], factor, strict=False)]
    step = scheduler.last_epoch
    for i, (group, base) in enumerate(zip(groups, scheduler.base_lrs, strict=False)):
        group["initial_lr"] = base
        group["lr"] = base * scheduler.lr_lambdas[i](step)  # as LambdaLR.get_lr computes it
    from disttrain.runtime.torch_compat import set_last_lr  # the one place torch's private names live

    set_last_lr(scheduler, [g["lr"] for g in groups])


def _carried_factor(saved_config: dict | None, base_lrs: list) -> list[float]:
    """Per group, the factor the checkpoint's base LR carried over its configured lr (a
    rescale_lr resume scaled it), to carry over to the new lr. A configured lr of 0 (or
    one that is not a finite number) says nothing of a factor: 1, the new lr as given."""
    optim = (saved_config or {}).get("optim")
    saved_lr = optim.get("lr") if isinstance(optim, dict) else None
    if not isinstance(saved_lr, (int, float)) or isinstance(saved_lr, bool) or not math.isfinite(saved_lr):
        saved_lr = 0
    return [old / saved_lr if saved_lr else 1.0 for old in base_lrs]


def print_changes(who: str, plan: ResumePlan | None, batch_policy: str) -> None:
    """Rank 0: a "checkpoint -> now" table of the applied keys that changed (rich),
    titled with `who` ('disttrain job', 'disttrain train')."""
    if plan is None or not plan.changes or (dist.is_initialized() and dist.get_rank() != 0):
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{who}: config changed since the checkpoint (applied)")
    for column in ("key", "checkpoint", "now"):
        table.add_column(column, style="bold" if column == "key" else None)
    for key, old, new in plan.changes:
        table.add_row(key, _fmt(old), _fmt(new))
    if any(k in ("train.batch_size", "train.accum_steps") for k, _, _ in plan.changes):
        table.caption = f"batch size and accumulation follow elastic.batch_policy = {batch_policy!r}"
    Console().print(table)


def rejoin(
    who: str, step: int, acc, sampler, batch_policy: str, data_parallel: tuple[int, int], optimizer, scheduler
) -> str:
    """After a checkpoint at `step` was loaded: the accumulator's step count, the batch
    policy for this run's data-parallel size (accum_steps or the LR, P-ELASTIC-3) and the
    sampler re-cut for it. `data_parallel` is (rank, size) over the data-parallel ranks:
    the ranks of one tensor-parallel group read one batch, so a TP group counts once in
    the global batch. Returns the "resumed at" line (`who` names who speaks: 'job'
    or 'train'), for the loop to say when it trains. Raises the policy's `UserError`
    when the saved global batch cannot be kept at this world size."""
    acc.optimizer_steps = step
    rank, world_size = data_parallel
    acc.accum_steps, note = apply_batch_policy(
        batch_policy,
        saved_global_batch=sampler.saved_global_batch,
        batch_size=sampler.batch_size,
        world_size=world_size,
        accum_steps=acc.accum_steps,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    sampler.reconfigure(world_size=world_size, rank=rank, accum_steps=acc.accum_steps)
    return (
        f"disttrain {who}: resumed at step {step} (epoch {sampler.epoch}, sample "
        f"{sampler.cursor}) on {world_size} data-parallel rank(s)" + (f"; {note}" if note else "")
    )
