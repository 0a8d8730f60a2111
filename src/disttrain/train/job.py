"""`Job`: the training loop of disttrain, for people who write their own and for
`disttrain train` (which builds its model, data and optimizer from the TOML and drives
a Job: train/trainer.py).

One object owns what a run needs around a user's model and data: the process group,
the checkpoint root and resume (with the "checkpoint -> now" comparison of the
hyper-parameters), the `ElasticSampler`'s commits, the per-step dropout seed,
preemption (SIGTERM -> an agreed stop, a save, exit 0), the guard and its slow phases,
evaluation, the run log, the progress bar, the summary and the final save, and, under
`disttrain run --fast-recovery`, the in-memory recovery. It is built on the parts
(runtime, parallel, data, checkpoint, elastic, guard, `Accumulator`)::

    import disttrain as dt
    with dt.Job(out_dir="runs/x", strategy="fsdp", checkpoint_every=100) as job:
        model = job.wrap(MyModel())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # after wrap
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # Job steps it
        loader = job.loader(dataset, batch_size=32)
        evaluator = job.evaluator(eval_set, batch_size=64, every=50)  # and at the last step
        job.evaluator(train_sample, batch_size=64, every=50, name="train_sample")
        job.resume(model=model, optimizer=opt, scheduler=sched)  # newest valid checkpoint
        for batch in job.steps(loader, max_steps=1000):
            loss = model(**batch).loss
            job.backward(loss)  # a window's last batch: the loop then steps optimizer and scheduler
            job.log(loss=loss)                           # metrics.jsonl and TensorBoard

The order is the contract: wrap, optimizer, loader (and evaluator), resume, steps;
each call out of order, and each object that did not come from this job, is one
`UserError`. Job steps what it was given: a script's own `optimizer.step()`,
`scheduler.step()` or `loss.backward()` inside the loop is one `UserError`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from disttrain import runtime, worker_notes
from disttrain.checkpoint import Checkpointer, TrainState, save_model
from disttrain.config import Config
from disttrain.config.fp8_rules import check_fp8
from disttrain.config.hf_model_config import hf_section
from disttrain.config.tp_rules import dp_coordinates
from disttrain.data import ElasticSampler
from disttrain.elastic import PreemptionHandler, SampleAudit, fast_recovery, generation_id
from disttrain.elastic.batch_policy import world_fits
from disttrain.errors import DistributedMismatchError, UserError
from disttrain.guard import RunGuard, start_guard
from disttrain.parallel import unwrap, wrap
from disttrain.runtime import failures
from disttrain.runtime.fault_injection import inject
from disttrain.runtime.log import LOGGER, set_speaker
from disttrain.train import job_failure, run_summary, start_point
from disttrain.train.accumulation import Accumulator
from disttrain.train.batches import to_device
from disttrain.train.evaluation import Evaluator, check_name, evaluate
from disttrain.train.job_config import JOB_KEYS, RunOptions, checkpoint_root, tracker_config
from disttrain.train.job_config import resolve as resolve_config
from disttrain.train.metrics_window import MetricsWindow
from disttrain.train.non_finite_stop import NonFiniteStop
from disttrain.train.optimizer_order import built_after, optimizer_mark, watch_optimizers
from disttrain.train.sample_queue import SampleQueue
from disttrain.train.save_cadence import Saving
from disttrain.train.step_ownership import BACKWARD_MESSAGE, Ownership, require_backward
from disttrain.train.tracker_checks import check_trackers
from disttrain.train.trackers import from_config as tracker_list
from disttrain.train.trackers import open_trackers
from disttrain.train.trackers import resolve as resolve_trackers


def _ignore_stop_signals(worker_id: int, chain=None) -> None:
    """A DataLoader worker's start: SIGTERM/SIGINT are the job's to handle (an agreed stop
    and a save); a worker that died of them would crash the rank before it saves. The
    workers end when the rank's loader is done with them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if chain is not None:
        chain(worker_id)


# The parts of a run, each built once by the call that the contract's order puts first
# (`__enter__`, `loader`, `resume`, `steps`) and held in one place: the Job's attribute
# for that call's record, None until the call ran. The loop receives them complete.


@dataclass(frozen=True)
class _Started:
    """What entering the job starts beside the process group: the handler of the stop
    signals (an agreed stop and a save) and the guard."""

    preemption: PreemptionHandler
    guard: RunGuard


@dataclass(frozen=True)
class _TrainData:
    """What `Job.loader` builds: the sampler (its position is checkpointed), the
    DataLoader drawing from it, and the queue of the indices the loader drew."""

    sampler: ElasticSampler
    loader: DataLoader
    samples: SampleQueue


@dataclass(frozen=True)
class _Training:
    """What `Job.resume` adds: the accumulator (where the optimizer steps), the state a
    checkpoint holds (model, optimizer, scheduler, scaler, sampler, extras) and the
    save cadence."""

    accumulator: Accumulator
    state: TrainState
    saving: Saving


@dataclass(frozen=True)
class _Looping:
    """What `Job.steps` opens for the loop: the metrics window and the non-finite stop."""

    metrics: MetricsWindow
    non_finite: NonFiniteStop


class Job:
    """A resumable data-parallel training job; use it as a context manager (README,
    "Use it in your own loop": wrap, loader, resume, steps, backward, log).

    Entering starts the process group (from the torchrun environment; none under a
    plain `python`; under fast recovery the generation's group), installs the
    SIGTERM/SIGINT handler and runs the guard's start checks (a collective; ranks that
    disagree raise `DistributedMismatchError` on every rank). Leaving restores the
    handlers and shuts down the group it started, on every path. Construction refuses
    a negative period, `accum_steps`, `log_every` or `tp` below 1, and an unknown
    `batch_policy` or `on_error` (`UserError`); a bad strategy or wrap option is a
    `ConfigError` from `job.wrap`, before the model is changed.

    Args:
        out_dir: Holds `checkpoints/`, `metrics.jsonl`, the final `model.pt`,
            `summary.json` (and `samples/`); the same script run again resumes from it.
        config (Config | None): The TOML's own sections (`disttrain.config.Config`):
            [parallel] (strategy, backend, device, timeout_s and `dt.wrap`'s options),
            [train] (accum_steps, seed, precision, fp8_recipe, log_every, compile), [optim]
            (grad_clip), [checkpoint] (every, every_s, keep_last, async_mode, fallback,
            on_error, enabled, dir), [elastic] (batch_policy, record_samples,
            preempt_grace_s, buddy_every), [guard], [log] (tensorboard, wandb,
            mlflow); sections about the model and data are `disttrain train`'s. None:
            `Config()`, whose fields hold the one default of each setting (a short
            keyword left out is its field's default, as in `disttrain train`). Under
            `disttrain run` the preemption grace is the launcher's
            (`DISTTRAIN_PREEMPT_GRACE_S`), else `elastic.preempt_grace_s`.
        run (RunOptions | None): What only an adapter passes (`dt.RunOptions`).
        strategy: For `dt.wrap`: 'ddp', 'zero1', 'fsdp', 'fsdp1' or 'dp'.
        precision: 'fp32', 'bf16', 'fp16' or 'fp8' for `dt.wrap` (forward under autocast,
            outputs in fp32; fp8: torchao's Float8 linear layers, the rest bf16, on a GPU of
            compute capability 8.9 or higher, `train.fp8_recipe` its scaling). fp16 makes
            no grad scaler by itself: pass `scaler=dt.make_grad_scaler("fp16")` to
            `resume`, or small gradients vanish.
        accum_steps: Micro-batches per optimizer step.
        checkpoint_every: A checkpoint every this many optimizer steps (0: off; also
            every `checkpoint.every_s` seconds, on preemption and at the end).
        seed: Every RNG at start (the same model on every rank); dropout then from
            (seed, step, rank), the data order from (seed, epoch): resumes bit-identical.
        grad_clip: Clip the global gradient norm to this (0: off); logged as `grad_norm`.
        record_samples: Write each step's sample indices under `samples/` (an audit).
        tensorboard: Also write the metrics as TensorBoard events in `out_dir/tb`.
        check: The runtime checks of `disttrain run --check` for the first
            `guard.check_steps` optimizer steps and one epoch boundary (docs/check.md):
            a bug that makes the results wrong stops the run with exit status 3.
        tp: Tensor-parallel degree (`parallel.tp`): the layers of the plan split over
            this many consecutive ranks, which read the same batches; the data-parallel
            strategy spans world / tp ranks (docs/strategies.md "2D").
        tp_plan (dict | None): For `dt.wrap`: {module name with `*`: 'colwise',
            'rowwise', 'sequence' or a torch `ParallelStyle`}; None: the config's
            `parallel.tp_plan`, else the model's own `tp_plan` (the built-in GPT has one).
        sequence_parallel: With tp > 1, the built-in GPT's norms run on 1/tp of the
            sequence (`parallel.sequence_parallel`).
        loss_parallel: With tp > 1, the built-in GPT's logits stay split over the
            vocabulary and its loss (the model's own) is computed on them
            (`parallel.loss_parallel`); `job.backward` runs under torch's `loss_parallel`.
        progress: Rank 0's progress bar.
        trackers (str | list | None): "wandb", "mlflow", `dt.WandbTracker(...)`,
            `dt.MlflowTracker(...)` or a list of them: rank 0 sends each metrics record,
            the config, restarts and world-size changes there; a resumed or restarted
            run continues the same tracker run (a missing package is a `UserError` here).
            None: those the config's [log] names.

    Each short keyword that is not None overrides the config's field; any other
    keyword is Python's own `TypeError`.
    """

    # The parts a run holds, each in one place, None until the call that builds it:
    _handoff: fast_recovery.Handoff | None  # __enter__: fast recovery's hand-off, or None
    _info: runtime.RankInfo | None  # __enter__: this rank's place (the process group)
    _started: _Started | None  # __enter__
    _model: torch.nn.Module | None  # wrap: the wrapped model
    _data: _TrainData | None  # loader
    _training: _Training | None  # resume
    _looping: _Looping | None  # steps

    def __init__(
        self,
        out_dir: str | Path,
        config: Config | None = None,
        *,
        run: RunOptions | None = None,
        strategy: str | None = None,
        precision: str | None = None,
        accum_steps: int | None = None,
        checkpoint_every: int | None = None,
        seed: int | None = None,
        grad_clip: float | None = None,
        record_samples: bool | None = None,
        tensorboard: bool | None = None,
        check: bool | None = None,
        tp: int | None = None,
        tp_plan: dict | None = None,
        sequence_parallel: bool | None = None,
        loss_parallel: bool | None = None,
        progress: bool = True,
        trackers=None,
    ):
        short = dict(
            strategy=strategy,
            precision=precision,
            accum_steps=accum_steps,
            seed=seed,
            checkpoint_every=checkpoint_every,
            grad_clip=grad_clip,
            record_samples=record_samples,
            tensorboard=tensorboard,
            check=check,
            tp=tp,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )
        self.run = run or RunOptions()
        self._tp_plan = tp_plan
        try:
            self.cfg: Config = self._settings(config, short)
            """The configuration this job runs with (the config given, the keywords applied)."""
            self.trackers = resolve_trackers(trackers) if trackers is not None else tracker_list(self.cfg.log)
            if int(os.environ.get("RANK", "0")) == 0:  # rank 0 sends to the trackers: before any collective
                check_trackers(self.trackers, from_config=trackers is None)
        except UserError as e:
            job_failure.refuse_at_start(self.name, e)
        self.out_dir = Path(out_dir)
        self.checkpoint_dir = checkpoint_root(self.cfg, self.out_dir)
        self.show_progress = progress
        self._user_config: dict = {}
        self._handoff = self._info = self._started = self._model = None
        self._data = self._training = self._looping = None
        self.evaluators: list[Evaluator] = []
        self._owns_group = False
        self._wrap_mark: int | None = None
        self._hf_section: dict | None = None
        self._start = start_point.Resumed()  # where resume() found the run: said by steps()
        set_speaker(f"disttrain {self.name}")  # fast recovery's messages too
        watch_optimizers()  # an optimizer built before this is one built before wrap
        self._owner = Ownership()
        self.step = 0
        """Optimizer steps done: after `resume`, the checkpoint's step; inside
        `steps()`, the steps completed before the current batch (the batch belongs to
        step `job.step + 1`); after the loop, `max_steps`."""
        self.preempted = False
        self.summary: dict | None = None
        self._in_step = self._backward_done = False

    # ------------------------------------------------------------------ setup

    def _settings(self, config: Config | None, short: dict) -> Config:
        """The job's `Config` (`job_config.resolve`), its values checked. Raises `UserError`."""
        cfg = resolve_config(config, short)
        c, t = cfg.checkpoint, cfg.train
        if c.every < 0 or c.every_s < 0 or t.accum_steps < 1 or t.log_every < 1 or cfg.parallel.tp < 1:
            raise UserError(
                f"dt.Job: checkpoint.every ({c.every}) and checkpoint.every_s ({c.every_s}) "
                f"must be >= 0, train.accum_steps ({t.accum_steps}), train.log_every "
                f"({t.log_every}) and parallel.tp ({cfg.parallel.tp}) >= 1."
            )
        for name, value, allowed in (
            ("batch_policy", cfg.elastic.batch_policy, ("keep_global", "rescale_lr")),
            ("on_error", c.on_error, ("stop", "continue")),
        ):
            if value not in allowed:
                raise UserError(f"dt.Job: {name} {value!r} is not one of {', '.join(map(repr, allowed))}.")
        device = cfg.parallel.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        check_fp8(t.precision, t.fp8_recipe, device)  # before the process group starts, not at wrap
        return cfg

    def __enter__(self) -> Job:
        import torch.distributed as dist

        self._handoff = fast_recovery.current()
        self._owns_group = not dist.is_initialized()
        p = self.cfg.parallel
        self._info = runtime.init(backend=p.backend, device=p.device, timeout_s=p.timeout_s, seed=self.cfg.train.seed)
        try:
            self._started = started = self._start_parts()
            if self._handoff is not None:
                self._handoff.keep(guard=started.guard)
            if self.cfg.guard.check:  # before wrap: the checks see the DDP being built
                from disttrain.check.session import install

                install(self.cfg.guard.check_steps)
        except BaseException as e:
            self._end(e)
            raise
        return self

    def _start_parts(self) -> _Started:
        """The stop-signal handler, then the guard's start checks (a collective); the
        handler is removed again when those fail. Under fast recovery, ranks new to the
        job (a node that joined) that fail those checks alone are not admitted and the
        job goes on without them (`fast_recovery.Handoff.refuse_newcomers`)."""
        # The grace `disttrain run` gives its workers (the kill follows it), else the config's.
        grace = os.environ.get("DISTTRAIN_PREEMPT_GRACE_S") or self.cfg.elastic.preempt_grace_s
        preemption = PreemptionHandler(float(grace)).install()
        try:
            guard = start_guard(
                self.cfg.guard, config=self.config(), timeout_s=self.cfg.parallel.timeout_s, **self.run.guard_fields
            )
        except DistributedMismatchError as e:
            preemption.uninstall()
            if self._handoff is not None:
                self._handoff.refuse_newcomers(e)
            raise
        except BaseException:
            preemption.uninstall()
            raise
        if self._handoff is not None:
            self._handoff.veteran = True
        return _Started(preemption, guard)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._end(exc)

    def _end(self, exc: BaseException | None) -> None:
        """Close the job; under `disttrain run` a failure ends as `job_failure` judges it
        (a user error or the program's error: not retried; a lost peer: one line). The
        judgement comes first: its note must be there when a peer's collective fails."""
        ending = job_failure.judge(exc, self._failure_point()) if exc is not None else None
        # A rank that owes the launcher its line (a lost peer) keeps its stop handler until
        # the line is said: torchrun's agent sends SIGTERM as soon as the peer's process
        # ends, and its default action would end this rank silently.
        owes_line = ending is not None and ending.then is not None
        if exc is not None and self._handoff is None:
            self._close_trackers()
        self._close(keep_stop_handler=owes_line)
        if ending is not None:
            try:
                ending = ending.settled()
            finally:
                if owes_line and self._started is not None:
                    self._started.preemption.uninstall()
            # A SIGTERM while closing was the launcher acting on the note already
            stopped = self._started is not None and self._started.preemption.requested
            if ending.wait and not stopped:
                worker_notes.wait_to_be_stopped()
            raise failures.JudgedExit(ending.status) from None

    def _data_parallel(self) -> tuple[int, int]:
        """(data-parallel rank, size): the ranks of one TP group read the same batches."""
        info = self.info
        return dp_coordinates(info.rank, info.world_size, self.cfg.parallel.tp)

    def _world_fits(self, sampler, acc) -> Callable[[int], bool]:
        """Whether the job can go on at a world of N ranks: whole TP groups, and a
        data-parallel size the batch policy keeps this run's global batch at."""
        tp, policy = self.cfg.parallel.tp, self.cfg.elastic.batch_policy
        global_batch = sampler.batch_size * self._data_parallel()[1] * acc.accum_steps
        return lambda world: world % tp == 0 and world_fits(policy, global_batch, sampler.batch_size, world // tp)

    def _records_samples(self) -> bool:
        """One rank of each TP group records its group's samples (`elastic.record_samples`)."""
        return self.cfg.elastic.record_samples and self.info.rank % self.cfg.parallel.tp == 0

    def _begin_step(self) -> None:
        """A step's first micro-batch: dropout from (seed, step, rank), for an exact resume;
        the step marked for the crash-loop breaker of the process watching this rank."""
        info = self.info  # the ranks of one TP group draw one stream: they hold the same activations
        runtime.seed_step(self.step, dataclasses.replace(info, rank=self._data_parallel()[0]))
        worker_notes.mark_step(self.step + 1, run=str(self.checkpoint_dir))

    def _close_trackers(self) -> None:
        """After a failure on the restart path: the trackers record the last step they
        hold, so the next attempt sends each step once (an in-memory recovery keeps them
        open instead). A tracker's own failure here must not replace the job's error."""
        if self._looping is None:
            return
        try:
            self._looping.metrics.close()
        except Exception as e:  # noqa: BLE001  (the job's own failure is what is reported)
            LOGGER.warning(f"disttrain job: a tracker failed to close after the failure: {type(e).__name__}: {e}")

    def _failure_point(self) -> job_failure.FailurePoint:
        """What `job_failure.judge` needs of this job, and nothing else."""
        info, t, handoff = self._info, self._training, self._handoff
        return job_failure.FailurePoint(
            name=self.name,
            rank=info.rank if info is not None else int(os.environ.get("RANK", "0")),
            step=self.step_in_flight,
            in_memory_recovery=handoff is not None,
            oom_facts=lambda: job_failure.oom_facts(
                self._model,
                t.state.optimizer if t is not None else None,
                self.strategy,
                info.world_size if info is not None else 1,
                self.precision,
            ),
            peer_gone=lambda: handoff is not None and handoff.peer_gone(),
        )

    def _close(self, keep_stop_handler: bool = False) -> None:
        """Close what the job opened; the stop signals' handler stays installed when
        `keep_stop_handler` (the caller uninstalls it)."""
        if "disttrain.check.session" in sys.modules:  # `check`: the summary, the hooks removed
            from disttrain.check.session import finish

            finish()
        self._owner.close()
        if self._started is not None:
            self._started.guard.close()
            if not keep_stop_handler:
                self._started.preemption.uninstall()
        if self._owns_group:
            runtime.shutdown()

    def config(self) -> dict:
        """What each checkpoint stores as the run's config (and a resume compares): the
        adapter's `config`, or this job's settings, after `wrap` of a Hugging Face model
        its model section (`model.hf`, `model.hf_config`: what `ckpt export --hf` reads),
        and, after `resume`, the optimizer's hyper-parameters (`start_point.optim_config`)."""
        if self.run.stored_config is not None:
            return self.run.stored_config
        t = self.cfg.train
        options = {**({"compile": True} if t.compile else {}), **self.run.wrap_options}
        own = {
            "strategy": self.strategy,
            "accum_steps": t.accum_steps,
            "seed": t.seed,
            "precision": self.precision,
            **{k: repr(v) for k, v in options.items()},
        }
        return {"job": own, **({"model": self._hf_section} if self._hf_section else {})}

    def log_config(self, values: dict) -> None:
        """Add the script's own settings to the run's config that the trackers get (W&B
        config, MLflow params; the whole run's config is there already: the job's
        sections, the optimizer's hyper-parameters), e.g. `job.log_config({"model":
        "resnet18", "data": "cifar10"})`. Call it on any rank, any time: before `steps()`
        the values go with the config, after it they are sent at once. A later call
        adds to earlier ones (MLflow keeps a parameter's first value: it cannot change
        one). Raises `UserError` for a `values` that is not a dict with string keys, or a
        key that is one of the job's own sections (`tracker_config`)."""
        if not isinstance(values, dict) or not all(isinstance(k, str) and k for k in values):
            raise UserError("dt.Job.log_config() takes a dict of your settings, e.g. {'model': 'resnet18'}.")
        taken = sorted(set(values) & {*JOB_KEYS, "job", "model", "data"})
        if taken:
            raise UserError(
                f"dt.Job.log_config(): {', '.join(taken)} is a section of the job's own config, which "
                f"the trackers get already; name your settings otherwise (e.g. 'my_{taken[0]}')."
            )
        self._user_config.update(values)
        trackers = self._looping.metrics.trackers if self._looping is not None else None
        if trackers is not None:
            trackers.add_config(values)

    def tracker_config(self) -> dict:
        """The run's config as the trackers get it: `job_config.tracker_config` of this
        job's settings, what its checkpoints store, and the script's `log_config` values."""
        whole, state = self.run.stored_config is not None, self._training.state if self._training else None
        stored = state.config if state is not None else self.config()
        if state is not None and not whole:  # which optimizer and scheduler the script built
            opt, sched = state.optimizer, state.scheduler
            named = {"optimizer": type(opt).__name__, **({"scheduler": type(sched).__name__} if sched else {})}
            stored = {**stored, "optim": {**stored.get("optim", {}), **named}}
        return tracker_config(self.cfg, stored, self._user_config, whole=whole)

    def _need(self, done: bool, message: str) -> None:
        if self._info is None:
            raise UserError(
                "dt.Job is used outside its `with dt.Job(...) as job:` block; enter it "
                "first (it starts the process group)."
            )
        if not done:
            raise UserError(message)

    @property
    def name(self) -> str:
        """How the job speaks: 'job' (a script's dt.Job) or 'train' (`disttrain train`)."""
        return "job" if self.run.stored_config is None else "train"

    @property
    def strategy(self) -> str:
        """`parallel.strategy`: how `wrap` distributes the model."""
        return self.cfg.parallel.strategy

    @property
    def precision(self) -> str:
        """`train.precision`: 'fp32', 'bf16', 'fp16' or 'fp8'."""
        return self.cfg.train.precision

    @property
    def info(self) -> runtime.RankInfo:
        """This rank's place in the job (`dt.rank_info()`: rank, world size, device);
        a `UserError` outside the job's `with` block."""
        self._need(True, "")
        assert self._info is not None  # _need: inside the with block
        return self._info

    @property
    def device(self) -> torch.device:
        """This rank's device (`dt.rank_info().device`); move tensors that are not
        part of a batch from `steps()` (which arrive moved) here."""
        return self.info.device

    @property
    def resumed(self) -> bool:
        """`resume` loaded a checkpoint or a survivor's memory (False: a fresh start)."""
        return self._start.resumed

    @property
    def in_memory(self) -> bool:
        """`resume` took the state from a survivor's memory (fast recovery)."""
        return self._start.in_memory

    @property
    def step_in_flight(self) -> int:
        """The step a failure now belongs to: the one the current batch trains (from a
        window's closing backward, the step just taken); 0 before the loop starts."""
        t = self._training
        return t.accumulator.step_in_flight if t is not None and self._looping is not None else 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`dt.wrap(model, strategy=..., precision=...)` once per job; build the optimizer
        from the returned module afterwards (one built before is refused by `resume`).
        A second call is a `UserError`."""
        self._need(self._model is None, "dt.Job.wrap() is called once per job; this job already wrapped a model.")
        self._wrap_mark = optimizer_mark()
        self._hf_section = hf_section(model)  # a Hugging Face model: `ckpt export --hf` rebuilds it
        self._model = wrapped = wrap(
            model,
            self.cfg.parallel,
            precision=self.precision,
            **{
                "compile": self.cfg.train.compile,
                "fp8_recipe": self.cfg.train.fp8_recipe,
                "tp_plan": self._tp_plan if self._tp_plan is not None else (self.cfg.parallel.tp_plan or None),
                **self.run.wrap_options,
            },
        )
        if self._handoff is not None:
            # Each rank's TP shards are its own, under ddp too: a buddy keeps a copy of them.
            sharded = self.strategy != "ddp" or self.cfg.parallel.tp > 1
            self._handoff.attach_buddy(sharded, self.cfg.elastic.buddy_every)
        return wrapped

    def loader(
        self, dataset, batch_size: int, *, drop_last: bool = False, shuffle: bool = True, **loader_kwargs: Any
    ) -> DataLoader:
        """A DataLoader over `dataset` (a map-style dataset: `len` and `[i]`) drawn by an
        `ElasticSampler`: this rank's share of a global order that depends on (seed,
        epoch) only, resumable mid-epoch at any world size; the epoch advances by
        itself. `batch_size` is per rank and micro-step. `loader_kwargs` go to
        `DataLoader` (num_workers, pin_memory, persistent_workers, collate_fn, ...);
        workers ignore SIGTERM/SIGINT, which are the job's. `sampler`, `shuffle` and
        `batch_sampler` are the job's. One training loader per job (`evaluator` for
        an eval set)."""
        self._need(
            self._data is None,
            "dt.Job.loader() is called once per job, for the training "
            "set; pass an eval set to job.evaluator(...) instead.",
        )
        taken = {"sampler", "batch_sampler", "generator"} & set(loader_kwargs)
        if taken:
            raise UserError(
                f"dt.Job.loader(): {', '.join(sorted(taken))} are the job's (an "
                f"ElasticSampler makes resume exact); pass shuffle=, drop_last= instead."
            )
        if loader_kwargs.get("num_workers", 0) > 0:
            chain = loader_kwargs.pop("worker_init_fn", None)
            loader_kwargs["worker_init_fn"] = lambda i: _ignore_stop_signals(i, chain)
        dp_rank, dp_size = self._data_parallel()
        sampler = ElasticSampler(
            dataset,
            rank=dp_rank,
            world_size=dp_size,
            batch_size=batch_size,
            accum_steps=self.cfg.train.accum_steps,
            seed=self.cfg.train.seed,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        samples = SampleQueue(sampler)
        # A private generator: iter(loader) must not draw from the global (dropout) RNG.
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=samples,
            drop_last=True,
            generator=torch.Generator().manual_seed(self.cfg.train.seed),
            **loader_kwargs,
        )
        self._data = _TrainData(sampler, loader, samples)
        return loader

    def evaluator(
        self,
        dataset,
        batch_size: int,
        *,
        every: int = 0,
        max_batches: int | None = None,
        metric=None,
        collate_fn=None,
        at_start: bool = False,
        name: str = "heldout",
    ) -> Evaluator:
        """Evaluate on `dataset` every `every` steps and at the last step, split across
        the ranks (`train/evaluation.py`: equal forwards per rank, global means from
        (sum, count)); `metric(model, batch) -> {metric: value}` adds metrics beyond the
        loss (default: {"loss": the model's loss}). Each result goes into metrics.jsonl
        as `<name>_<metric>` (`heldout_loss` by default; the trackers too) and into
        `evaluator.last` ({metric: value}, without the name). Each evaluation runs under
        `torch.no_grad()` with the model in `eval()` mode, restored after; the watchdog
        treats the evaluation as a slow phase. `every=0` evaluates at the last step only;
        `max_batches` caps the batches per rank (None: the whole set); `at_start=True` also
        evaluates before the first step of a fresh run (not of a resumed one); `collate_fn`
        goes to the DataLoader. Call it before `resume`, once per eval set: several
        evaluators, each with its own `name` (a lowercase identifier, e.g. "val",
        "train_sample"), run in the order built. A `batch_size` or `max_batches` below 1, a
        negative `every`, a repeated or malformed name, the name "train" (the loop's own
        `loss` is the run's train loss) or a call after `resume` is a `UserError`."""
        self._need(self._training is None, "dt.Job.evaluator() is called before job.resume().")
        check_name(name, [e.name for e in self.evaluators])
        ev = Evaluator(
            dataset,
            batch_size,
            every=every,
            max_batches=max_batches,
            metric=metric,
            collate=collate_fn,
            at_start=at_start,
            name=name,
            tp=self.cfg.parallel.tp,
        )
        self.evaluators.append(ev)
        return ev

    def resume(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler=None,
        scaler=None,
        extras: dict | None = None,
    ) -> bool:
        """Load the newest valid checkpoint into the model, optimizer, scheduler, scaler,
        extras and the loader's sampler; True when one was loaded (or, under fast
        recovery, the state came from a survivor's memory), False on a fresh start.
        Changed hyper-parameters (the optimizer's lr, weight decay, betas, momentum; a
        `disttrain train` config's applied keys) take effect, shown as a "checkpoint ->
        now" table when `steps()` starts training (a run already at its max_steps says
        only that it is complete); at another world size the batch policy applies.
        `scaler`: fp16's loss scaler (`dt.make_grad_scaler("fp16")`), which the job does
        not make by itself. A collective.
        Raises `UserError` for a model that is not this job's `wrap()` result, an
        optimizer built before wrap, or a call before `loader()`; a damaged or
        mismatched checkpoint raises the checkpoint layer's error."""
        self._need(self._model is not None, "dt.Job.resume(): wrap the model with job.wrap() first.")
        self._need(
            model is self._model, "dt.Job.resume(model=...) must be the module job.wrap() returned (the wrapped one)."
        )
        self._need(
            built_after(optimizer, self._wrap_mark or 0),
            "dt.Job.resume(): the optimizer was built before job.wrap(); build it after, from "
            "the module job.wrap() returned (under FSDP the old parameters no longer train).",
        )
        self._need(
            self._data is not None,
            "dt.Job.resume(): build the loader with job.loader() "
            "first; its sampler position is part of the checkpoint.",
        )
        self._need(self._training is None, "dt.Job.resume() is called once per job, before job.steps().")
        started, data = self._started, self._data
        assert started is not None and data is not None  # inside the with block, after loader()
        # Construction checks the optimizer holds the wrapped model's parameters (P-DDP-3).
        acc = Accumulator(
            model,
            optimizer,
            self.cfg.train.accum_steps,
            scheduler=scheduler,
            grad_clip=self.cfg.optim.grad_clip,
            scaler=scaler,
        )
        started.guard.check_model(model, optimizer)
        self._owner.watch(optimizer, scheduler)
        state = TrainState(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            sampler=data.sampler,
            extras=extras or {},
        )
        c = self.cfg.checkpoint
        ckpt = (
            Checkpointer(self.checkpoint_dir, keep_last=c.keep_last, async_mode=c.async_mode, fallback=c.fallback)
            if c.enabled
            else None
        )
        if self._handoff is not None:  # the checkpointer's gloo group: cut in a recovery
            self._handoff.publish_listeners()
        saving = Saving(
            ckpt,
            state,
            started.guard,
            every=c.every,
            every_s=c.every_s,
            on_error=c.on_error,
            who=f"disttrain {self.name}",
        )
        self._training = _Training(acc, state, saving)  # before the load: a failed one is not retried
        self._start = start_point.load(self._resume_inputs(state, data.sampler, started.guard), ckpt, acc)
        self.step = self._start.step
        return self.resumed

    def _resume_inputs(self, state: TrainState, sampler: ElasticSampler, guard: RunGuard) -> start_point.ResumeInputs:
        """What `start_point.load` reads of this job, and nothing else."""
        return start_point.ResumeInputs(
            name=self.name,
            state=state,
            config=self.config(),
            whole_config=self.run.stored_config is not None,
            checkpoint_dir=self.checkpoint_dir,
            batch_policy=self.cfg.elastic.batch_policy,
            sampler=sampler,
            data_parallel=self._data_parallel(),
            guard=guard,
            handoff=self._handoff,
        )

    # ------------------------------------------------------------------ the loop

    def steps(self, loader: DataLoader, max_steps: int) -> Iterator[Any]:
        """Yield micro-batches (moved to this rank's device) until `max_steps` optimizer
        steps are done; the epoch advances by itself. Call `job.backward(loss)` exactly
        once per batch. Each step: dropout seeded from (seed, step, rank), the sampler
        committed, checkpoints and evaluations at their periods. At `max_steps`: a
        checkpoint, `out_dir/model.pt` (rank 0, prefix-free) and `summary.json`. On
        SIGTERM every rank stops after the same step, saves and exits 0
        (`SystemExit(0)`), so the same command resumes; code after the loop does not
        run. A job whose checkpoint is already at `max_steps` yields nothing and says
        so. Breaking out of the loop ends it without a save; a step whose last backward
        ran before the break is kept (`job.step` counts it). `job.step` is the number of
        optimizer steps done: inside the loop, the batch belongs to step `job.step + 1`."""
        self._need(
            self._training is not None,
            "dt.Job.steps(): call job.resume(model=..., optimizer=...) first (it loads the newest checkpoint).",
        )
        started, data, t = self._started, self._data, self._training
        self._need(
            data is not None and loader is data.loader,
            "dt.Job.steps() takes the loader job.loader() returned; another loader's position is not checkpointed.",
        )
        self._need(not self._in_step and self._looping is None, "dt.Job.steps() runs once per job.")
        assert started is not None and data is not None and t is not None  # resume() ran: it needed them all
        return self._step_loop(started, data, t, max_steps)

    def _step_loop(self, started: _Started, data: _TrainData, t: _Training, max_steps: int) -> Iterator[Any]:
        """The one training loop, top to bottom. Per batch: the dropout seed, the user's
        forward and `job.backward` (the `yield`), on a window's last batch the optimizer
        step and its commit, then each part at its own cadence: evaluation, the metrics
        record, the preemption vote (stop), the save; after the loop, `_finish`."""
        # complete already: says so, trains nothing
        if not start_point.say_resumed(self.name, self.step, max_steps, self._start, self.cfg.elastic.batch_policy):
            return
        acc, model, saving, guard, info = t.accumulator, t.state.model, t.saving, started.guard, self.info
        audit = SampleAudit(self.out_dir / "samples", *self._data_parallel(), self._records_samples(), generation_id())
        non_finite = NonFiniteStop(model, lambda: saving.saved_at)
        saving.check = non_finite.check  # before each save, on every rank
        self._looping = looping = _Looping(self._metrics_window(data, acc, max_steps), non_finite)
        metrics, stopping = looping.metrics, False
        fits = self._world_fits(data.sampler, acc)  # the worlds a node that joins may make (fixed here)
        saving.start(self.step)
        # The evaluation at the start (not after an in-memory recovery: it does not wait).
        metrics.start(evaluate(self.evaluators, model, guard, lambda ev: ev.at_start and not self.in_memory))
        while self.step < max_steps and not stopping:
            for batch in data.loader:  # each pass is a new epoch: the sampler advances
                guard.first_batch(batch, self.cfg.parallel.tp)
                if acc.window_start:
                    self._begin_step()
                with acc.micro_step():  # no gradient sync unless it closes the window
                    inject("forward", self.step + 1, info.rank)  # where the user's forward fails
                    self._in_step, self._backward_done = True, False
                    self._owner.before_user()
                    try:
                        yield to_device(batch, info.device)  # the user's forward and job.backward
                    except GeneratorExit:  # the script left the loop: a window its backward closed steps
                        self._owner.left_loop()
                        if self._backward_done and acc.boundary:
                            acc.end_micro_step()
                            self._take_batch(data, audit)
                            self._commit(acc, data.sampler, audit)
                        raise
                    finally:
                        self._in_step = False
                    self._owner.after_user()
                    require_backward(self._backward_done)
                    acc.end_micro_step()  # the window's last batch: clip, optimizer and scheduler step
                self._take_batch(data, audit)
                if not acc.stepped:
                    continue
                self._commit(acc, data.sampler, audit)
                if self._handoff is not None:  # fast recovery's buddy copy of this step
                    self._handoff.committed(self.step, t.state)
                inject("step", self.step, info.rank)
                guard.step(self.step, model)
                metrics.after_step(
                    self.step,
                    evaluate(
                        self.evaluators,
                        model,
                        guard,  # skipped when a SIGTERM's grace no longer fits it
                        lambda ev: ev.due(self.step, max_steps) and started.preemption.time_for(ev.seconds),
                    ),
                )
                regroup = self._handoff is not None and self._handoff.joiners_waiting(fits)
                stopping = started.preemption.should_stop(regroup)  # agreed by all ranks (one all-reduce)
                saving.after_step(self.step, stopping)
                if stopping or self.step >= max_steps:
                    break
                if self._handoff is not None and started.preemption.regroup_agreed:
                    self._handoff.admit_joiners(self.step, t.state, fits)  # a new generation with the joined node
        self._finish(started, t, looping, stopping)

    def _finish(self, started: _Started, t: _Training, looping: _Looping, stopping: bool) -> None:
        """After the loop: the final save, then either the preemption's stop (`stopping`:
        the ranks agreed to stop on a signal; `job.preempted`, the launcher's "saved"
        note, `SystemExit(0)` when `exit_on_preempt`) or the non-finite check (when the final
        save did not run it), the prefix-free `model.pt` and `job.summary` (rank 0 writes
        `summary.json`)."""
        saving, metrics, info, model = t.saving, looping.metrics, self.info, t.state.model
        saving.finish(self.step)
        metrics.close()
        started.guard.close()
        if stopping:
            self.preempted = True
            if saving.ckpt is not None and saving.saved_at == self.step:
                worker_notes.note_saved(info.rank, self.step)  # the launcher says "saved"
            LOGGER.info(
                f"disttrain {self.name}: preempted ({started.preemption.signal_name}); saved step "
                f"{self.step} and stopped. Start the same command again to resume."
            )
            if self.run.exit_on_preempt:
                raise SystemExit(0)
            return
        if saving.checked_at != self.step:
            looping.non_finite.check(self.step)
        # An adapter (HFCausalLM) saves its inner model's own keys: model.pt loads strict there.
        path = save_model(model, self.out_dir / "model.pt", strip=getattr(unwrap(model), "export_prefix", ""))
        self.summary = run_summary.build(
            self.out_dir,
            steps=self.step,
            world_size=info.world_size,
            strategy=self.strategy,
            attempt_t0=metrics.t0,
            samples_per_step=metrics.samples_per_step,
            tokens_per_sample=self.run.tokens_per_sample,
            final=metrics.final,
            resumed=self.resumed,
            extra={"checkpoint": str(path), **self.run.summary_extra},
            eval_names=tuple(ev.name for ev in self.evaluators),
            attempt=metrics.run_log.attempt,
        )
        if info.is_main:
            run_summary.write(self.out_dir, self.summary, self.run.summary_config or self.config())

    def _metrics_window(self, data: _TrainData, acc: Accumulator, max_steps: int) -> MetricsWindow:
        """This attempt's metrics: rank 0 opens the trackers (a restart continues their runs)."""
        info = self.info
        trackers = (
            open_trackers(self.trackers, self.checkpoint_dir, self.out_dir, self.tracker_config())
            if info.is_main
            else None
        )
        assert data.loader.batch_size is not None  # loader() always sets one
        return MetricsWindow(
            info,
            self.out_dir,
            max_steps=max_steps,
            start_step=self.step,
            resumed=self.resumed,
            samples_per_step=data.loader.batch_size * acc.accum_steps * self._data_parallel()[1],
            tokens_per_sample=self.run.tokens_per_sample,
            log_every=self.cfg.train.log_every,
            accumulator=acc,
            trackers=trackers,
            tensorboard=self.cfg.log.tensorboard,
            progress=self.show_progress,
        )

    def _take_batch(self, data: _TrainData, audit: SampleAudit) -> None:
        """The batch just trained on: its sample indices into the audit, which records
        them with the step they belong to (`_commit`)."""
        assert data.loader.batch_size is not None  # loader() always sets one
        audit.add(torch.tensor(data.samples.take(data.loader.batch_size)))

    def _commit(self, acc: Accumulator, sampler: ElasticSampler, audit: SampleAudit) -> None:
        """The optimizer step just taken, in the job's counters: its number, the sampler's
        cursor and the audit. No collective: it also runs when the script leaves the loop
        right after the step (evaluation, records and saves then wait for the next loop or
        the script's own save)."""
        self.step = acc.optimizer_steps
        sampler.commit_step()
        audit.commit(self.step)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` inside `job.steps()`: divided by the accumulation window,
        no gradient sync except on its last micro-batch. After that batch's code (or
        when the loop is left after this backward), the optimizer and the scheduler
        given to `resume` step. Raises `UserError` outside the loop, twice
        per batch, or after the script's own `loss.backward()` of the same loss."""
        self._need(self._in_step, "dt.Job.backward() is called inside `for batch in job.steps(...)`, once per batch.")
        self._need(
            not self._backward_done,
            "dt.Job.backward() was already called for this batch; add the losses and call it once.",
        )
        t, looping = self._training, self._looping
        assert t is not None and looping is not None  # inside steps(): both are there
        inject("backward", self.step + 1, self.info.rank)
        looping.non_finite.watch_loss(loss, self.step + 1)
        try:
            t.accumulator.backward(loss)
        except RuntimeError as e:
            if self._owner.second_backward(e):
                raise UserError(BACKWARD_MESSAGE) from None
            raise
        self._backward_done = True

    def log(self, **values: float | torch.Tensor) -> None:
        """Record numbers for the optimizer step this batch belongs to, e.g.
        `job.log(loss=loss)`; call it inside `for batch in job.steps(...)`, on every rank
        (the record is a collective). Every `log_every` steps each value becomes one
        number: its mean over the calls of those steps on every rank (one all-reduce of
        (sum, count)); the learning rate ("lr"), the gradient norm (with `grad_clip`),
        samples/s (tokens/s), every rank's step time and peak memory are added, and
        rank 0 appends the record to `out_dir/metrics.jsonl` and TensorBoard
        (`out_dir/tb`). Raises `UserError` outside the loop or for a value that is
        not a number or a one-element tensor."""
        self._need(self._in_step, "dt.Job.log() is called inside `for batch in job.steps(...)`, on every rank.")
        assert self._looping is not None  # inside steps(): built before the first batch
        self._looping.metrics.add(values)
