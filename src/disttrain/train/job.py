"""`Job`: a resumable training loop for people who write their own.

One object owns what `disttrain train` does around a user's model and data: the
process group, the checkpoint root and resume, the `ElasticSampler`'s commits, the
per-step dropout seed, preemption (SIGTERM -> an agreed stop, a save, exit 0), the
guard and the final save. It is built on the parts (runtime, parallel, data,
checkpoint, elastic, guard, `Accumulator`) and re-implements none of them::

    import disttrain as dt
    with dt.Job(out_dir="runs/x", strategy="fsdp", checkpoint_every=100) as job:
        model = job.wrap(MyModel())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # after wrap
        loader = job.loader(dataset, batch_size=32)
        job.resume(model=model, optimizer=opt)           # newest valid checkpoint, if any
        for batch in job.steps(loader, max_steps=1000):
            loss = model(**batch).loss
            job.backward(loss)
            job.log(loss=loss)                           # metrics.jsonl and TensorBoard

The order is the contract: wrap, optimizer, loader, resume, steps; each call out of
order, and each object that did not come from this job, is one `UserError`.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from disttrain import runtime
from disttrain.checkpoint import Checkpointer, TrainState, save_model
from disttrain.data import ElasticSampler
from disttrain.elastic import PreemptionHandler, SampleAudit, generation_id
from disttrain.errors import UserError
from disttrain.guard import start_guard, tensor_nbytes
from disttrain.parallel import wrap
from disttrain.runtime.fault_injection import inject
from disttrain.train.loop import Accumulator
from disttrain.train.metrics import JsonlWriter, global_sum, print_main
from disttrain.train.resume import rejoin
from disttrain.train.run_log import RunLog
from disttrain.train.sources import to_device


class _Recorded(torch.utils.data.Sampler[int]):
    """The job's `ElasticSampler` as the DataLoader reads it: every index it hands out
    is queued, so each batch the loop receives knows its samples (the audit), whatever
    the dataset's items look like and however far the loader prefetches."""

    def __init__(self, sampler: ElasticSampler):
        self.sampler, self.queue = sampler, collections.deque()

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        self.queue.clear()
        for i in self.sampler:
            self.queue.append(i)
            yield i

    def take(self, n: int) -> list[int]:
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]


class Job:
    """A resumable data-parallel training job; use it as a context manager.

    `out_dir` holds `checkpoints/`, the final `model.pt` and (with `record_samples`)
    `samples/`, the audit of which samples each step trained on. `strategy` and
    `wrap_options` go to `dt.wrap`; `accum_steps`, `grad_clip` to the `Accumulator`;
    `batch_policy` ('keep_global' or 'rescale_lr') applies when a checkpoint comes
    from another world size. `checkpoint_every` (0: only at the end and on
    preemption) and `keep_last` to the `Checkpointer`. `preempt_grace_s` None reads
    DISTTRAIN_PREEMPT_GRACE_S (set by `disttrain run`), else 60. `tensorboard` False
    keeps `job.log` to `out_dir/metrics.jsonl` (no `out_dir/tb` event files).

    Entering starts the process group (from the torchrun environment; none under a
    plain `python`), installs the SIGTERM/SIGINT handler and runs the guard's start
    checks (a collective: every rank enters with the same arguments). Leaving
    restores the handlers and shuts the group down on every path, exceptions
    included. A checkpoint that cannot be written or read raises the checkpoint
    layer's error on every rank; nothing is retried silently.
    """

    def __init__(self, out_dir: str | Path, *, strategy: str = "ddp", checkpoint_every: int = 100,
                 accum_steps: int = 1, seed: int = 0, grad_clip: float = 0.0, precision: str = "fp32",
                 keep_last: int = 3, batch_policy: str = "keep_global", record_samples: bool = False,
                 preempt_grace_s: float | None = None, backend: str = "auto", device: str = "auto",
                 timeout_s: float = 300.0, tensorboard: bool = True, **wrap_options: Any):
        if checkpoint_every < 0 or accum_steps < 1:
            raise UserError(f"dt.Job: checkpoint_every ({checkpoint_every}) must be >= 0 and "
                            f"accum_steps ({accum_steps}) >= 1.")
        if batch_policy not in ("keep_global", "rescale_lr"):
            raise UserError(f"dt.Job: batch_policy {batch_policy!r} is not one of 'keep_global', "
                            f"'rescale_lr'.")
        self.out_dir = Path(out_dir)
        self.strategy, self.precision, self.wrap_options = strategy, precision, wrap_options
        self.checkpoint_every, self.accum_steps, self.seed = checkpoint_every, accum_steps, seed
        self.grad_clip, self.keep_last, self.batch_policy = grad_clip, keep_last, batch_policy
        self.record_samples, self.preempt_grace_s = record_samples, preempt_grace_s
        self.tensorboard, self._run_log, self._logged = tensorboard, None, {}
        self._init = dict(backend=backend, device=device, timeout_s=timeout_s, seed=seed)
        self.info: runtime.RankInfo | None = None
        self.model = self._sampler = self._loader = self._acc = self._ckpt = self._state = None
        self._audit = self._guard = self._preempt = None
        self.step = 0
        """Optimizer steps done (after `resume`, the checkpoint's)."""
        self.resumed = self.preempted = False
        self._in_step = self._backward_done = False

    # ------------------------------------------------------------------ setup

    def __enter__(self) -> "Job":
        self.info = runtime.init(**self._init)
        try:
            self._preempt = PreemptionHandler(self.preempt_grace_s).install()
            self._guard = start_guard(config=self._config(), timeout_s=self._init["timeout_s"])
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        if self._guard is not None:
            self._guard.close()
        if self._preempt is not None:
            self._preempt.uninstall()
        runtime.shutdown()

    def _config(self) -> dict:
        return {"strategy": self.strategy, "accum_steps": self.accum_steps, "seed": self.seed,
                "precision": self.precision, **{k: repr(v) for k, v in self.wrap_options.items()}}

    def _need(self, done: bool, message: str) -> None:
        if self.info is None:
            raise UserError("dt.Job is used outside its `with dt.Job(...) as job:` block; enter it "
                            "first (it starts the process group).")
        if not done:
            raise UserError(message)

    @property
    def device(self) -> torch.device:
        return self.info.device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`dt.wrap(model, strategy=..., precision=...)` once per job; build the optimizer
        from the returned module afterwards. A second call is a `UserError`."""
        self._need(self.model is None, "dt.Job.wrap() is called once per job; this job already "
                                       "wrapped a model.")
        self.model = wrap(model, strategy=self.strategy, precision=self.precision, **self.wrap_options)
        return self.model

    def loader(self, dataset, batch_size: int, *, drop_last: bool = False, shuffle: bool = True,
               **loader_kwargs: Any) -> DataLoader:
        """A DataLoader over `dataset` (a map-style dataset: `len` and `[i]`) drawn by an
        `ElasticSampler`: this rank's share of a global order that depends on (seed,
        epoch) only, resumable mid-epoch at any world size; the epoch advances by
        itself. `batch_size` is per rank and micro-step. `loader_kwargs` go to
        `DataLoader` (num_workers, collate_fn, ...); `sampler`, `shuffle` and
        `batch_sampler` are the job's. One loader per job."""
        self._need(self._loader is None, "dt.Job.loader() is called once per job; iterate the "
                                         "loader it returned.")
        taken = {"sampler", "batch_sampler", "generator"} & set(loader_kwargs)
        if taken:
            raise UserError(f"dt.Job.loader(): {', '.join(sorted(taken))} are the job's (an "
                            f"ElasticSampler makes resume exact); pass shuffle=, drop_last= instead.")
        self._sampler = ElasticSampler(dataset, batch_size=batch_size, accum_steps=self.accum_steps,
                                       seed=self.seed, shuffle=shuffle, drop_last=drop_last)
        # A private generator: iter(loader) must not draw from the global (dropout) RNG.
        self._loader = DataLoader(dataset, batch_size=batch_size, sampler=_Recorded(self._sampler),
                                  drop_last=True, generator=torch.Generator().manual_seed(self.seed),
                                  **loader_kwargs)
        return self._loader

    def resume(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None,
               scaler=None, extras: dict | None = None) -> bool:
        """Load the newest valid checkpoint under `out_dir/checkpoints` into the model,
        optimizer, scheduler, scaler, extras and the loader's sampler; True when one
        was loaded, False on a fresh start. At another world size the batch policy
        applies. A collective. Raises `UserError` for a model that is not this job's
        `wrap()` result, an optimizer built before wrap, or a call before `loader()`;
        a damaged or mismatched checkpoint raises the checkpoint layer's error."""
        self._need(self.model is not None, "dt.Job.resume(): wrap the model with job.wrap() first.")
        self._need(model is self.model, "dt.Job.resume(model=...) must be the module job.wrap() "
                                        "returned (the wrapped one).")
        self._need(self._loader is not None, "dt.Job.resume(): build the loader with job.loader() "
                                             "first; its sampler position is part of the checkpoint.")
        self._need(self._acc is None, "dt.Job.resume() is called once per job, before job.steps().")
        # Construction checks the optimizer holds the wrapped model's parameters (P-DDP-3).
        acc = Accumulator(model, optimizer, self.accum_steps, scheduler=scheduler,
                          grad_clip=self.grad_clip, scaler=scaler)
        self._guard.check_model(model, optimizer)
        self._ckpt = Checkpointer(self.out_dir / "checkpoints", keep_last=self.keep_last)
        self._state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                 sampler=self._sampler, extras=extras or {}, config=self._config())
        with self._guard.slow_phase("checkpoint.load"):
            loaded = self._ckpt.load(self._state)
        self.resumed = loaded is not None
        if self.resumed:
            self.step = self._state.step
            rejoin("job", self.step, acc, self._sampler, self.batch_policy, self.info, optimizer, scheduler)
        self._audit = SampleAudit(self.out_dir / "samples", self.info.rank, self.info.world_size,
                                  self.record_samples, generation_id())
        self._acc = acc
        self._run_log = RunLog(self.out_dir, self.info, self.step, self.resumed, self.tensorboard)
        return self.resumed

    # ------------------------------------------------------------------ the loop

    def steps(self, loader: DataLoader, max_steps: int) -> Iterator[Any]:
        """Yield micro-batches (moved to this rank's device) until `max_steps` optimizer
        steps are done; the epoch advances by itself. Call `job.backward(loss)` exactly
        once per batch. Each step: dropout seeded from (seed, step, rank), the sampler
        committed, a checkpoint every `checkpoint_every` steps. At `max_steps`: a
        checkpoint and `out_dir/model.pt` (rank 0, prefix-free). On SIGTERM every rank
        stops after the same step, saves and exits 0 (`SystemExit(0)`), so the same
        command resumes; code after the loop does not run. A job whose checkpoint is
        already at `max_steps` yields nothing and says so. Breaking out of the loop ends
        it without a save (the newest checkpoint stays the resume point)."""
        self._need(self._acc is not None, "dt.Job.steps(): call job.resume(model=..., "
                                          "optimizer=...) first (it loads the newest checkpoint).")
        self._need(loader is self._loader, "dt.Job.steps() takes the loader job.loader() returned; "
                                           "another loader's position is not checkpointed.")
        self._need(not self._in_step, "dt.Job.steps() is already running; one loop per job.")
        if self.step >= max_steps:
            print_main(f"disttrain job: complete, the checkpoint is at step {self.step} of "
                       f"{max_steps}; nothing to train (use a new out_dir or a larger max_steps).")
            return
        acc, rank, guard = self._acc, self.info.rank, self._guard
        saved_at, stopping = self.step, False
        while self.step < max_steps and not stopping:
            for batch in loader:  # each pass is a new epoch: the sampler advances itself
                guard.first_batch(batch)
                if acc.window_start:  # dropout from (seed, step, rank): exact resume
                    runtime.seed_step(self.step)
                inject("forward", self.step + 1, rank)
                with acc.micro_step():
                    self._in_step, self._backward_done = True, False
                    try:
                        yield to_device(batch, self.info.device)
                    finally:
                        self._in_step = False
                    if not self._backward_done:
                        raise UserError("each batch from job.steps() needs one job.backward(loss) "
                                        "before the next; this one had none.")
                self._audit.add(torch.tensor(self._loader.sampler.take(loader.batch_size)))
                if not acc.stepped:
                    continue
                self.step = acc.optimizer_steps
                self._sampler.commit_step()
                self._audit.commit(self.step)
                inject("step", self.step, rank)
                guard.step(self.step, self.model)
                self._write_log()
                stopping = self._preempt.should_stop()  # agreed by all ranks (one all-reduce)
                if stopping or (self.checkpoint_every and self.step % self.checkpoint_every == 0):
                    saved_at = self._save()
                if stopping or self.step >= max_steps:
                    break
        if saved_at != self.step:
            self._save()
        self._ckpt.close()
        guard.close()
        if stopping:
            self.preempted = True
            print_main(f"disttrain job: preempted ({self._preempt.signal_name}); saved step "
                       f"{self.step} and stopped. Start the same command again to resume.")
            raise SystemExit(0)
        save_model(self.model, self.out_dir / "model.pt")

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` inside `job.steps()`: divided by the accumulation window,
        no gradient sync except on its last micro-batch, where the optimizer (and the
        scheduler) step. Raises `UserError` outside the loop or twice per batch."""
        self._need(self._in_step, "dt.Job.backward() is called inside `for batch in job.steps(...)`, "
                                  "once per batch.")
        self._need(not self._backward_done, "dt.Job.backward() was already called for this batch; "
                                            "add the losses and call it once.")
        inject("backward", self.step + 1, self.info.rank)
        self._acc.backward(loss)
        self._backward_done = True

    def log(self, **values: float | torch.Tensor) -> None:
        """Record numbers for the optimizer step this batch belongs to, e.g.
        `job.log(loss=loss)`; call it inside `for batch in job.steps(...)`, on every rank
        (the record is a collective). Values given several times in one step (one call
        per micro-batch) are averaged. After the step, each value is averaged over the
        ranks (one all-reduce: every rank's batches have one size, so a per-batch mean
        loss becomes the global mean), the optimizer's learning rate ("lr"), the
        gradient norm (with `grad_clip`), samples/s, every rank's step time and peak
        memory are added, and rank 0 appends the record to `out_dir/metrics.jsonl` and
        writes it to TensorBoard (`out_dir/tb`). Raises `UserError` outside the loop or
        for a value that is not a number or a one-element tensor."""
        self._need(self._in_step, "dt.Job.log() is called inside `for batch in job.steps(...)`, "
                                  "on every rank.")
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UserError(f"dt.Job.log({key}=...) got {type(value).__name__}; pass a number "
                                f"or a one-element tensor, e.g. job.log(loss=loss).")
            total, count = self._logged.get(key, (0.0, 0))
            self._logged[key] = (total + float(value), count + 1)

    def _write_log(self) -> None:
        """The step's `log` values as one record (a collective; see `log`)."""
        if not self._logged:
            return
        keys = sorted(self._logged)  # the same order on every rank
        means = global_sum([self._logged[k][0] / self._logged[k][1] for k in keys])
        world = self.info.world_size
        record = {**{k: v / world for k, v in zip(keys, means)}, "step": self.step, "world_size": world}
        record.setdefault("lr", self._state.optimizer.param_groups[0]["lr"])
        self._logged = {}
        self._run_log.log(record, self._acc.last_grad_norm,
                          samples_per_step=self._loader.batch_size * self._acc.accum_steps * world)
        JsonlWriter(self.out_dir / "metrics.jsonl").write(record)

    def _save(self) -> int:
        self._state.step, self._state.epoch = self.step, self._sampler.epoch
        nbytes = tensor_nbytes(self.model, self._state.optimizer)
        with self._guard.slow_phase("checkpoint.save", nbytes=nbytes):
            self._ckpt.save(self._state)
        return self.step
