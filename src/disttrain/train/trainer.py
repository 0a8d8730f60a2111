"""The per-rank job of `disttrain train`: the config-driven trainer.

Written on the layers below it (runtime, parallel, data, checkpoint, elastic, guard)
and the demo model and corpus, so it doubles as the reference for a user's own loop.
`disttrain.launch.train_command` validates the config and starts it on every rank
(`python -m disttrain.train`); a config error never starts a process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from disttrain import runtime
from disttrain.checkpoint import Checkpointer, CheckpointSaveError, TrainState, save_model
from disttrain.config import Config, to_dict
from disttrain.data import ElasticSampler
from disttrain.demo.corpus import ChunkDataset
from disttrain.elastic import PreemptionHandler, SampleAudit, fast_recovery, generation_id
from disttrain.guard import path_nbytes, start_guard, tensor_nbytes
from disttrain.guard.run_guard import logical_name
from disttrain.parallel import make_optimizer, unwrap, wrap
from disttrain.parallel.precision import make_grad_scaler
from disttrain.runtime.fault_injection import inject
from disttrain.train.loop import Accumulator, warmup_cosine
from disttrain.train.metrics import JsonlWriter, MeanTracker, global_mean, print_main
from disttrain.train.progress import TrainProgress, print_summary
from disttrain.train.run_log import RunLog
from disttrain.train import resume, sources


def build_optimizer(model: torch.nn.Module, cfg: Config, ndims: dict[str, int]) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as in GPT-2) or SGD, over the wrapped model.

    `ndims` maps each parameter's name in the unwrapped model to its dimension count,
    taken before `wrap`: FSDP1 flattens parameters to 1-D views, so the wrapped model's
    own shapes would put every matrix in the no-decay group."""
    o = cfg.optim
    named = [(logical_name(n), q) for n, q in unwrap(model).named_parameters() if q.requires_grad]
    params = [q for _, q in named]
    if o.name == "sgd":
        return make_optimizer(model, torch.optim.SGD, params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    dims = [ndims.get(n, q.dim()) for n, q in named]  # a name wrap invented: its own shape
    decay = [q for (_, q), d in zip(named, dims) if d >= 2]
    no_decay = [q for (_, q), d in zip(named, dims) if d < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # ZeRO-1 under strategy zero1, a plain optimizer otherwise (P-FSDP-9).
    return make_optimizer(model, torch.optim.AdamW, groups, lr=o.lr, betas=tuple(o.betas))


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: ChunkDataset, batch_size: int, max_batches: int) -> float:
    """Held-out loss (nats/token), the exact mean over `sources.eval_shard`'s chunks
    (P-LOOP-2). A collective: every rank runs the same number of forwards (FSDP
    all-gathers in each), so a rank with one chunk fewer pads its last batch with a
    repeat of a chunk that is weighted 0."""
    info = runtime.rank_info()
    model.eval()
    mine, per_rank = sources.eval_shard(len(dataset), batch_size, max_batches)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))
    total, count = 0.0, 0.0
    for start in range(0, per_rank, batch_size):
        x, y = (torch.stack(t) for t in zip(*(dataset[i] for i in mine[start:start + batch_size])))
        logits, _ = model(x.to(info.device), y.to(info.device))
        w = torch.tensor(weights[start:start + batch_size], dtype=torch.float64)
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(logits.device).flatten(),
                                                reduction="none").view(y.shape).sum(1)
        total += float((nll.double().cpu() * w).sum())
        count += float(w.sum()) * y.shape[1]
    model.train()
    return global_mean(total, count)


def train(cfg: Config, config_dir: str | Path | None = None) -> dict:
    """Run one training job in this process (one rank). Returns the summary dict.

    The model, data and loss come from `disttrain.train.sources`: the built-in GPT on
    the stdlib corpus, or the config's model.factory / data.factory / train.loss,
    imported from `config_dir` (the config file's folder; None: sys.path only).

    Resumes from the newest valid checkpoint when there is one (no flag), so a
    torchrun restart continues where the job stopped. On SIGTERM every rank stops
    after the same step, saves, and returns with `summary["preempted"]` True.
    """
    p, t = cfg.parallel, cfg.train
    if fast_recovery.enabled():  # a child of the slot supervisor: elastic.fast_recovery
        def attempt(info: runtime.RankInfo, handoff: fast_recovery.Handoff) -> dict:
            preempt = PreemptionHandler(cfg.elastic.preempt_grace_s).install()
            try:
                return _train(cfg, info, preempt, config_dir, handoff)
            finally:
                preempt.uninstall()
        return fast_recovery.run(attempt, backend=p.backend, device=p.device, timeout_s=p.timeout_s,
                                 seed=t.seed, prepare=lambda h: _datasets(cfg, config_dir, h),
                                 sharded=p.strategy != "ddp", buddy_every=cfg.elastic.buddy_every)
    with runtime.distributed(backend=p.backend, device=p.device, timeout_s=p.timeout_s,
                             seed=t.seed) as info:
        preempt = PreemptionHandler(cfg.elastic.preempt_grace_s).install()
        try:
            return _train(cfg, info, preempt, config_dir)
        finally:
            preempt.uninstall()


def _datasets(cfg: Config, config_dir, handoff: fast_recovery.Handoff | None):
    """`sources.build_datasets`, kept across the attempts of a fast recovery (a spare
    builds them while it waits)."""
    if handoff is None:
        return sources.build_datasets(cfg, config_dir)
    return handoff.cached("datasets", lambda: sources.build_datasets(cfg, config_dir))


def _train(cfg: Config, info: runtime.RankInfo, preempt: PreemptionHandler, config_dir,
           handoff: fast_recovery.Handoff | None = None) -> dict:
    t0 = time.perf_counter()
    p, t = cfg.parallel, cfg.train
    # The newest checkpoint's config against this one: a changed model or dataset is
    # refused before anything is built or written; a finished run is left as it is.
    plan = resume.inspect(cfg)
    if plan is not None and plan.step >= t.steps:
        print_main(resume.complete_message(plan))
        return {"steps": plan.step, "world_size": info.world_size, "complete": True, "preempted": False}
    # The built-in GPT on the stdlib corpus, or the config's factories (train/sources.py).
    train_set, heldout_set, data_info = _datasets(cfg, config_dir, handoff)
    loss_fn = sources.build_loss(cfg, config_dir)
    builtin = sources.uses_builtin_model(cfg) and not cfg.data.factory and loss_fn is None
    # The byte corpus counts tokens (block_size per sample); a user's dataset counts samples.
    unit, per_item = ("sample", 1) if cfg.data.factory else ("token", cfg.model.block_size)

    def run_eval() -> float:  # a collective: equal forwards on every rank
        if heldout_set is None:
            return float("nan")
        if builtin:
            return evaluate(model, heldout_set, t.batch_size, t.eval_batches)
        return sources.evaluate(model, heldout_set, t.batch_size, t.eval_batches, loss_fn,
                                torch.utils.data.default_collate)
    # Fingerprint, launch checks and hang watchdog, before wrap (P-DEBUG-1,3).
    guard = start_guard(cfg.guard, config=cfg, timeout_s=p.timeout_s, dataset_len=len(train_set))
    if handoff is not None:
        handoff.keep(guard=guard)
    raw = sources.build_model(cfg, config_dir)
    ndims = {n: q.dim() for n, q in raw.named_parameters()}
    model = wrap(raw, p, precision=t.precision)  # bf16/fp16 (P-DDP-7, P-FSDP-5)
    optimizer = build_optimizer(model, cfg, ndims)  # after wrap (P-DDP-3)
    guard.check_model(model, optimizer)
    scheduler = warmup_cosine(optimizer, total_steps=t.steps, warmup_steps=cfg.optim.warmup_steps,
                              min_lr_ratio=cfg.optim.min_lr_ratio)
    acc = Accumulator(model, optimizer, t.accum_steps, scheduler=scheduler,
                      grad_clip=cfg.optim.grad_clip, scaler=make_grad_scaler(t.precision))
    # ElasticSampler: its (epoch, cursor) is checkpointed, so a resume continues mid-epoch
    # at any world size, every sample exactly once (P-DATA-3).
    sampler = ElasticSampler(len(train_set), batch_size=t.batch_size, accum_steps=t.accum_steps,
                             seed=t.seed, drop_last=cfg.data.drop_last)
    # A private generator: iter(loader) must not draw from the global (dropout) RNG.
    loader = DataLoader(sources.Indexed(train_set), batch_size=t.batch_size, sampler=sampler,
                        drop_last=True, generator=torch.Generator().manual_seed(t.seed))
    out = Path(t.out_dir)
    ckpt, state = _checkpointing(cfg, out, model, optimizer, scheduler, acc.scaler, sampler)
    fresh = resume.fresh_hyperparams(optimizer, scheduler)
    in_memory = False
    if handoff is not None:  # fast recovery: the state comes from a survivor's memory
        in_memory = handoff.gen > 0 and handoff.restore(state)  # a collective in generations > 0
    with guard.slow_phase("checkpoint.load", nbytes=path_nbytes(ckpt.root if ckpt else None)):
        loaded = ckpt.load(state) if ckpt is not None and not in_memory else None  # automatic resume (P-ELASTIC-3)
    resumed = loaded is not None or in_memory
    if in_memory:
        resume.rejoin("train", state.step, acc, sampler, cfg.elastic.batch_policy, info, optimizer, scheduler)
    elif resumed:
        if plan is None or plan.directory != str(loaded):  # the load fell back to another one
            plan = resume.plan_for(loaded, cfg)
            plan = plan.check() if plan is not None else None
        resume.apply(plan, optimizer, scheduler, fresh)  # before the batch policy scales the LR
        resume.rejoin("train", state.step, acc, sampler, cfg.elastic.batch_policy, info, optimizer, scheduler)
        resume.print_changes(plan, cfg.elastic.batch_policy)
    if handoff is not None:  # from here this attempt's objects hold the state a recovery keeps
        handoff.keep(state=state, acc=acc)
        handoff.committed(acc.optimizer_steps, state, first=True)  # the buddy copy of the starting state
    audit = SampleAudit(out / "samples", info.rank, info.world_size, cfg.elastic.record_samples,
                        generation_id())
    saved_at = step = acc.optimizer_steps
    log = JsonlWriter(out / "metrics.jsonl")
    tokens_per_step = t.batch_size * per_item * acc.accum_steps * info.world_size
    t_eval = time.perf_counter()
    with guard.slow_phase("eval"):  # slow phases: not steps to the hang watchdog
        first_eval = run_eval() if not in_memory else float("nan")  # a recovery does not wait for it
    eval_s = time.perf_counter() - t_eval  # after a SIGTERM, an eval that no longer fits is skipped
    progress = TrainProgress(t.steps, enabled=info.is_main, start=step,
                             unit=unit)
    run_log = RunLog(out, info, step, resumed, cfg.log.tensorboard)  # run_events.jsonl, tb/
    window, heldout_loss, train_loss = MeanTracker(), first_eval, float("nan")
    t_window, last_logged, stopping, first = time.perf_counter(), step, False, True
    while step < t.steps and not stopping:
        for batch, idx in loader:  # each pass is a new epoch: the sampler advances itself
            guard.first_batch(batch)
            if acc.window_start:  # dropout from (seed, step, rank): exact resume
                runtime.seed_step(step)
            inject("forward", step + 1, info.rank)
            with acc.micro_step():
                # model(**dict), model(*tuple) or model(batch); its loss, or train.loss
                loss = sources.batch_loss(model, sources.to_device(batch, info.device), loss_fn, first=first)
                first = False
                inject("backward", step + 1, info.rank)
                acc.backward(loss)
            window.update(loss.detach(), len(idx) * per_item)
            audit.add(idx)
            if not acc.stepped:
                continue
            step = acc.optimizer_steps
            sampler.commit_step()
            audit.commit(step)
            if handoff is not None:
                handoff.committed(step, state)
            inject("step", step, info.rank)
            guard.step(step, model)
            if step % t.log_every == 0 or step == t.steps:
                train_loss = window.compute()
                now = time.perf_counter()
                tok_s = (step - last_logged) * tokens_per_step / max(now - t_window, 1e-9)
                window.reset()
                t_window, last_logged = now, step
                record = {"step": step, "loss": train_loss, "lr": scheduler.get_last_lr()[0],
                          "tokens_per_s": tok_s, "world_size": info.world_size}
                if ((t.eval_every and step % t.eval_every == 0) or step == t.steps) \
                        and preempt.time_for(eval_s):  # keeps the grace for the save
                    with guard.slow_phase("eval"):
                        heldout_loss = run_eval()
                    record["heldout_loss"] = heldout_loss
                run_log.log(record, acc.last_grad_norm)  # per-rank step time, memory; TensorBoard
                log.write(record)
                progress.update(step, train_loss, heldout_loss, tok_s)
            stopping = preempt.should_stop()  # agreed by all ranks (one all-reduce)
            if stopping or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                with guard.slow_phase("checkpoint.save", nbytes=tensor_nbytes(model, optimizer)):
                    saved_at = _save(ckpt, state, step, cfg.checkpoint.on_error, saved_at)
            if stopping or step >= t.steps:
                break
    with guard.slow_phase("checkpoint.save", nbytes=tensor_nbytes(model, optimizer)):
        if saved_at != step:
            _save(ckpt, state, step, cfg.checkpoint.on_error, saved_at)
        if ckpt is not None:
            _close(ckpt, cfg.checkpoint.on_error)
    progress.close()
    guard.close()
    if stopping:
        print_main(f"disttrain train: preempted ({preempt.signal_name}); saved step {step} and "
                   f"stopped. Start the same command again to resume.")
        return {"steps": step, "preempted": True, "world_size": info.world_size}
    model_path = save_model(model, out / "model.pt")
    summary = {
        "steps": step, "world_size": info.world_size, "strategy": p.strategy,
        "initial_heldout_loss": first_eval, "final_train_loss": train_loss,
        "final_heldout_loss": heldout_loss, "wall_time_s": time.perf_counter() - t0,
        "tokens_seen": tokens_per_step * step, "checkpoint": str(model_path),
        "unit": unit,
        **data_info,
        "resumed": resumed, "preempted": False,
    }
    if info.is_main:
        (out / "summary.json").write_text(json.dumps({**summary, "config": to_dict(cfg)}, indent=2))
        print_summary(summary)
    return summary


def _checkpointing(cfg: Config, out: Path, model, optimizer, scheduler, scaler, sampler):
    """The run's `Checkpointer` (None when disabled) and its `TrainState` (also what a
    fast recovery hands over, with or without disk checkpoints)."""
    c = cfg.checkpoint
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       sampler=sampler, config=to_dict(cfg))
    if not c.enabled:
        return None, state
    return Checkpointer(resume.checkpoint_root(cfg), keep_last=c.keep_last,
                        async_mode=c.async_mode, fallback=c.fallback), state


def _save(ckpt, state, step: int, on_error: str, saved_at: int) -> int:
    """Checkpoint at `step`; returns the step of this attempt. A failed save stops the
    run, or with on_error = 'continue' warns and keeps training (the previous
    checkpoint stays latest; the same step is not retried). An earlier async save's
    failure reported here comes after this save was performed. A `StaleWriterError`
    (another job took the directory over) is not a `CheckpointSaveError`: it always
    propagates and stops the run."""
    if ckpt is None:
        return saved_at
    state.step, state.epoch = step, state.sampler.epoch
    try:
        ckpt.save(state)
        return step
    except CheckpointSaveError as e:
        if on_error == "stop":
            raise
        if runtime.rank_info().is_main:
            print(f"disttrain train: warning: {e} Training continues (checkpoint.on_error = "
                  f"'continue').", file=sys.stderr)
        return step


def _close(ckpt, on_error: str) -> None:
    """Complete the async save in flight; its `CheckpointSaveError` stops the run or,
    with on_error = 'continue', warns. A `StaleWriterError` always propagates."""
    try:
        ckpt.close()  # completes an async save in flight
    except CheckpointSaveError as e:
        if on_error == "stop":
            raise
        if runtime.rank_info().is_main:
            print(f"disttrain train: warning: {e}", file=sys.stderr)
