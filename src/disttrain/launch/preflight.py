"""Checks of a validated trainer config that need the machine, run in the launching
process before any worker starts (`disttrain train`, `disttrain run -m disttrain.train`):

- `check_writable`: `train.out_dir` and the checkpoint root are directories, or can be
  made, on a writable filesystem. A run that trained for hours must not learn at its
  first save that it cannot write (`disttrain.config.paths.writable_dir`).
- `check_memory`: the first step of the built-in GPT fits in the memory each process
  has, estimated with the planner's model (`disttrain.plan.memory`): weights,
  gradients, optimizer state and the activations of one micro-batch, against the
  whole memory of the device (a GPU), or the host's physical memory shared by the
  processes (CPU). Only a request that can never fit is refused, in one line with
  the numbers, so a busy machine never refuses a job that would run; a model of the
  user's own (model.factory, model.hf) is not estimated.
- `check_trackers`: the trackers `[log]` names can start: W&B online has an API key
  and reaches its server, MLflow's store is one MLflow accepts
  (`disttrain.train.tracker_checks`).
"""

from __future__ import annotations

from pathlib import Path

from disttrain.config import Config
from disttrain.config.paths import writable_dir
from disttrain.errors import ConfigError


def checkpoint_root(cfg: Config) -> Path:
    """checkpoint.dir, or {train.out_dir}/checkpoints (the trainer's rule)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.out_dir) / "checkpoints"


def check_writable(cfg: Config) -> None:
    """Raise `UserError` when the run's output or checkpoint directory cannot be written."""
    writable_dir(cfg.train.out_dir, "train.out_dir")
    if cfg.checkpoint.enabled:
        what = "checkpoint.dir" if cfg.checkpoint.dir else "train.out_dir's checkpoints folder"
        writable_dir(
            checkpoint_root(cfg), what, fix=f"Point {what} at a writable directory, or set checkpoint.enabled = false."
        )


def _gpt_spec(cfg: Config):
    from disttrain.plan.model_size import ModelSpec

    m = cfg.model
    h, L, V, T = m.n_embd, m.n_layer, m.vocab_size, m.block_size
    block = 12 * h * h + 13 * h
    n_params = 2 * V * h + T * h + L * block + 2 * h
    return ModelSpec(
        name="GPT",
        n_params=n_params,
        n_layer=L,
        hidden=h,
        n_head=m.n_head,
        ffn_hidden=4 * h,
        vocab_size=V,
        max_seq=T,
        block_params=block,
    )


def _variant(cfg: Config):
    from disttrain.plan.memory import Variant

    p = cfg.parallel
    if p.strategy == "zero1":
        name = "zero1"
    elif p.strategy in ("fsdp", "fsdp1") and p.sharding != "none":
        name = "fsdp_grad_op" if p.sharding == "grad_op" else "fsdp_full"
    else:
        name = "ddp"
    return Variant(name, cpu_offload=p.cpu_offload and name.startswith("fsdp"), act_ckpt=p.activation_checkpointing)


def _host_memory() -> int | None:
    """This host's physical memory (MemTotal) in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _device_memory(cfg: Config) -> tuple[int | None, str]:
    """(bytes one process may use, where they are), or None when unknown."""
    import torch

    device = cfg.parallel.device
    if device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count():
        return torch.cuda.get_device_properties(0).total_memory, "one GPU's memory"
    host = _host_memory()
    if host is None:
        return None, ""
    return host // cfg.parallel.nproc, f"this host's memory shared by {cfg.parallel.nproc} process(es)"


def check_memory(cfg: Config, world: int | None = None) -> None:
    """Raise `ConfigError` when the first step of the built-in GPT cannot fit in the
    memory of one process (see the module docstring). `world`: the job's ranks
    (default parallel.nproc), which FSDP shards over."""
    m = cfg.model
    if m.factory or m.hf or m.hf_path:
        return
    from disttrain.plan.memory import Workload, fmt_bytes, memory

    avail, where = _device_memory(cfg)
    if avail is None:
        return
    work = Workload(
        precision=cfg.train.precision,
        optimizer=cfg.optim.name,
        batch_per_device=cfg.train.batch_size,
        seq_len=m.block_size,
        gradient_as_bucket_view=cfg.parallel.gradient_as_bucket_view,
    )
    world = world or cfg.parallel.nproc
    if cfg.parallel.strategy == "dp":  # one process holds the whole batch of every device
        world = 1
    est = memory(_gpt_spec(cfg), work, world, _variant(cfg))
    need = est.total + (est.host if where.startswith("this host") else 0)
    if need <= avail:
        return
    state = est.params + est.grads + est.optim + est.host
    raise ConfigError(
        f"the first step needs about {fmt_bytes(need)} per process (weights, gradients and optimizer "
        f"state {fmt_bytes(state)}; activations of train.batch_size={cfg.train.batch_size} x "
        f"model.block_size={m.block_size}: {fmt_bytes(est.activations)}), more than the "
        f"{fmt_bytes(avail)} of {where}; lower train.batch_size (raise train.accum_steps to keep the "
        f"global batch), model.block_size or the model's size, or see `disttrain plan`."
    )


def check_trackers(cfg: Config) -> None:
    """Raise `UserError` when a tracker of `[log]` cannot start (see the module)."""
    from disttrain.train.tracker_checks import check_trackers as check
    from disttrain.train.trackers import from_config

    check(from_config(cfg.log), from_config=True)


def preflight(cfg: Config, world: int | None = None) -> None:
    """Every check of this module, in the launching process. Raises `UserError`."""
    check_memory(cfg, world)
    check_writable(cfg)
    check_trackers(cfg)
