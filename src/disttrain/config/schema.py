"""Typed configuration: kw_only dataclasses, a TOML file, dotted CLI overrides.

Precedence, one rule: CLI overrides > TOML file > dataclass defaults. Relative paths,
one rule (config/path_keys.py): a file's from its folder, an override's from the
current folder.

Every mistake (unknown key, wrong type, impossible value, hardware that cannot serve
the request) raises `ConfigError` with a message that names the key and the fix,
before any process starts. Fields carry their documentation as the string literal
that follows them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.config.data_config import DataConfig, check_data_source
from disttrain.config.elastic_config import ElasticConfig, check_elastic
from disttrain.config.fp8_rules import FP8_RECIPES, check_fp8
from disttrain.config.gpt_shape import GPTConfig
from disttrain.config.log_config import LogConfig, check_log
from disttrain.config.path_keys import anchor_override, anchor_paths
from disttrain.config.rules import check_values
from disttrain.config.tomlfile import apply_overrides, build, read_toml
from disttrain.config.tp_rules import check_gpt_tp, check_gpt_tp_options, check_tp, check_tp_options, check_tp_plan
from disttrain.config.user_code import check_model_keys, check_sources
from disttrain.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "zero1", "dp", "fsdp1")
FAST_RECOVERY_STRATEGIES = ("ddp", "fsdp")  # fsdp: each shard also in a buddy's memory
SHARDINGS = ("full", "grad_op", "hybrid", "none")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_STRATEGIES = ("ddp", "zero1", "fsdp")  # torchao's Float8 training composes with these


@dataclass(kw_only=True)
class ModelConfig(GPTConfig):
    """[model]: the built-in GPT's shape (the default), or a model of your own.

    `factory = "module:callable"` builds any `nn.Module` from `kwargs` (docs: README,
    "Your own model and data"); the GPT keys are then not allowed. `hf` / `hf_path` /
    `hf_config` select a Hugging Face model (`disttrain.train.hf_models`)."""

    factory: str = ""
    """'module:callable' returning an nn.Module; imported from the config file's folder, then sys.path."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for model.factory (plain TOML data)."""
    hf: str = ""
    """A Hugging Face model name (disttrain.train.hf_models)."""
    hf_path: str = ""
    """A local Hugging Face model folder (disttrain.train.hf_models)."""
    hf_config: dict = field(default_factory=dict)
    """Hugging Face config overrides (disttrain.train.hf_models)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """[parallel]: how the model is split across processes and devices (the strategy,
    its sharding and precision options) and how many processes a node starts."""

    strategy: str = "ddp"
    """One of ddp, fsdp, zero1, dp, fsdp1."""
    nproc: int = 2
    """Processes on this node. On CUDA at most the number of visible GPUs."""
    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""
    backend: str = "auto"
    """'auto' picks nccl for CUDA and gloo for CPU (P-INIT-1)."""
    timeout_s: float = 300.0
    """Collective timeout. Shorter than torch's 10/30 min default so a hang fails fast."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size (P-DDP-6): 10-25 for small models, 50-100 for large."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients alias the all-reduce buckets, saving one gradient copy."""
    static_graph: bool = False
    """DDP: only for graphs whose used-parameter set never changes."""
    find_unused_parameters: bool = False
    """DDP: only for models that skip parameters in some steps; costs 10-20% (P-DDP-4)."""
    sharding: str = "full"
    """FSDP: full (ZeRO-3), grad_op (ZeRO-2), hybrid (HSDP), none."""
    shard_group_size: int = 0
    """FSDP hybrid: ranks per shard group; 0 means the processes of one node."""
    wrap: str = "auto"
    """FSDP: 'auto' (per block), 'model' (whole model), or comma-separated class names."""
    cpu_offload: bool = False
    """FSDP: keep parameters, gradients and optimizer state on the CPU (P-FSDP-6)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them (P-FSDP-6)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to synchronised ones: global-batch statistics (P-DDP-8)."""
    tp: int = 1
    """Tensor-parallel degree: each layer split over this many consecutive ranks (1: none);
    it divides the world, which the data-parallel strategy (fsdp, or ddp at tp = world)
    spans in world / tp groups. docs/strategies.md "2D"."""
    sequence_parallel: bool = False
    """With tp > 1, the built-in GPT's norms (and the residual stream between its layers)
    run on 1/tp of the sequence: less activation memory, the same traffic."""
    loss_parallel: bool = False
    """With tp > 1, the built-in GPT's output layer and embedding split over the
    vocabulary, its cross entropy computed on the split logits (never gathered)."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """How parallel.tp splits the model, by module name (`*` for one part of a dotted name):
    {"blocks.*.attn.q" = "colwise", ...}, each 'colwise', 'rowwise' or 'sequence'; empty:
    the model's own plan (the built-in GPT's, or a Hugging Face model's published one)."""


@dataclass(kw_only=True)
class OptimConfig:
    """[optim]: the optimizer `disttrain train` builds, its warmup-cosine schedule and the
    gradient clipping that `dt.Job` (and so the trainer) applies at each step."""

    name: str = "adamw"
    """'adamw' or 'sgd'."""
    lr: float = 1e-3
    """Peak learning rate, reached after the warmup; a change since the checkpoint applies on resume."""
    weight_decay: float = 0.1
    """Weight decay of the parameters of 2 or more dimensions (matrices, embeddings); biases
    and norms get none."""
    momentum: float = 0.0
    """SGD only."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's (beta1, beta2)."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value (P-LOOP-5); 0 disables, so a loop's
    gradients are what it computed unless clipping is asked for."""
    warmup_steps: int = -1
    """Optimizer steps of linear warmup; -1 chooses min(5% of steps, 2000) (P-LOOP-4)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""


@dataclass(kw_only=True)
class TrainConfig:
    """[train]: the length of the run, the batch and its accumulation, precision, seed,
    evaluation and logging periods, and where the run's files go."""

    steps: int = 1000
    """Optimizer steps (not micro-steps)."""
    batch_size: int = 16
    """Sequences per rank per micro-step."""
    accum_steps: int = 1
    """Micro-steps per optimizer step; all-reduce runs only on the last (P-DDP-5)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, no scaler), fp16 (autocast with a gradient scaler) or fp8 (torchao's
    Float8 matmuls for the linear layers, the rest bf16; a GPU of compute capability >= 8.9)."""
    fp8_recipe: str = "tensorwise"
    """FP8 scaling under precision fp8: 'tensorwise' (one scale per tensor, fastest) or 'rowwise'."""
    seed: int = 1337
    """Seeds the model's initialisation, the data order and the per-step dropout."""
    log_every: int = 1
    """Optimizer steps between metrics records (metrics.jsonl, TensorBoard, the progress
    bar); each record is one small all-reduce."""
    eval_every: int = 250
    """Optimizer steps between held-out evaluations; 0 evaluates only at the end."""
    eval_batches: int = 20
    """Held-out batches per rank per evaluation."""
    loss: str = ""
    """Optional 'module:fn': fn(model, batch) -> scalar loss tensor; '' = the model's output."""
    out_dir: str = "runs/tiny_gpt"
    """Where rank 0 writes metrics.jsonl, the summary and checkpoints."""
    compile: bool = False
    """torch.compile each block before sharding (torchtitan's order); dt.wrap(compile=True)."""


@dataclass(kw_only=True)
class GuardConfig:
    """[guard]: runtime guardrails (P-DEBUG-1,3), on by default and cheap (<= 1% of step
    time): a start-of-run consistency check, replica checksums and a hang watchdog."""

    enabled: bool = True
    """Start-of-run consistency check, replica divergence check and hang watchdog."""
    divergence_every: int = 100
    """Optimizer steps between DDP replica checksums (one small all-reduce); 0 disables."""
    hang_factor: float = 20.0
    """A step longer than this x the median step time counts as a hang..."""
    hang_min_s: float = 60.0
    """...but never below this many seconds (evaluation and logging steps run longer)..."""
    hang_cap_s: float = 240.0
    """...and always at this cap (also used for the first steps; kept under parallel.timeout_s)."""
    tick_s: float = 1.0
    """Heartbeat period of the watchdog thread."""
    dir: str = ""
    """Heartbeat directory; '' is a per-job temp directory. Use a shared one for several nodes."""
    strict: bool = False
    """Turn 'looks distributed but is not' warnings into errors."""
    check: bool = False
    """Runtime checks of `disttrain run --check` (docs/check.md): a wrong-results bug stops the run, exit 3."""
    check_steps: int = 50
    """Optimizer steps the checks cover (then one epoch boundary); -1: every step."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """[checkpoint]: periodic, atomic, verified checkpoints and automatic resume from the
    newest valid one (P-CKPT-1..5), by step count and by the clock."""

    enabled: bool = True
    """Save checkpoints, and resume from the newest valid one on start (no flag needed)."""
    dir: str = ""
    """Checkpoint root; '' means {train.out_dir}/checkpoints. Shared by all nodes."""
    every: int = 0
    """Optimizer steps between saves; 0: none by step count (every_s and the end still save)."""
    every_s: float = 600.0
    """Seconds of training between saves, agreed by all ranks; 0 turns the clock off. A kill
    of a default run loses at most this much."""
    keep_last: int = 3
    """Committed checkpoints kept; older ones are deleted after a newer commit. 0 keeps all."""
    async_mode: str = "off"
    """'off' (synchronous) or 'thread' (DCP async_save; training continues during the write)."""
    fallback: bool = False
    """On resume, skip a corrupt newest checkpoint and load the previous valid one."""
    on_error: str = "stop"
    """A failed save: 'stop' the run, or 'continue' training (the previous checkpoint stays)."""


def _check_checkpoint(c: CheckpointConfig) -> None:
    _require(
        c.every >= 0 and c.keep_last >= 0,
        f"checkpoint.every ({c.every}) and checkpoint.keep_last ({c.keep_last}) must be >= 0.",
    )
    _require(
        c.every_s >= 0 and c.every_s != float("inf"),
        f"checkpoint.every_s ({c.every_s}) must be a finite number of seconds >= 0 (0 turns it off).",
    )
    _one_of("checkpoint.async_mode", c.async_mode, ("off", "thread"))
    _one_of("checkpoint.on_error", c.on_error, ("stop", "continue"))


@dataclass(kw_only=True)
class Config:
    """The whole run, one section per concern as in the TOML file: what `disttrain train`
    reads from its file and what `dt.Job(out_dir, config)` takes. Each field's default is
    the one default of its key, whichever way a run is made (`dt.Job(out_dir)` runs with
    `Config()`); `load_config` and `validate` check the values."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ---------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Build a validated `Config` from a TOML file and `--section.key=value` overrides.

    Every path key (`path_keys.PATH_KEYS`) comes back absolute when it was given: a
    relative one from the file is taken from the file's folder, one from an override
    from the current folder; a default stays as it is (relative to the current folder).
    Raises `ConfigError` naming the file or key on any problem; nothing else escapes
    for user mistakes.
    """
    raw = anchor_paths(read_toml(path), Path(path).parent) if path is not None else {}
    apply_overrides(raw, overrides, lambda key, value: anchor_override(key, value, "."))
    model = raw.get("model")
    if isinstance(model, dict):
        check_model_keys(model)
    cfg = build(Config, raw)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"config key {key!r} is {value!r}; choose one of {', '.join(allowed)}.")


def validate(cfg: Config) -> None:
    """Check values and their combinations. Raises `ConfigError` naming the key and fix."""
    t, p, m, o = cfg.train, cfg.parallel, cfg.model, cfg.optim
    for key, value in (
        ("train.steps", t.steps),
        ("train.batch_size", t.batch_size),
        ("train.accum_steps", t.accum_steps),
        ("parallel.nproc", p.nproc),
        ("model.n_layer", m.n_layer),
        ("model.n_head", m.n_head),
        ("model.block_size", m.block_size),
        ("train.log_every", t.log_every),
    ):
        _require(value >= 1, f"config key {key!r} is {value}; it must be at least 1.")
    _require(m.n_embd % m.n_head == 0, f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}).")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout is {m.dropout}; use a value in [0, 1).")
    _require(o.lr > 0, f"optim.lr is {o.lr}; it must be positive.")
    _require(o.grad_clip >= 0, f"optim.grad_clip is {o.grad_clip}; use 0 to disable or a positive norm.")
    _require(
        0.0 < cfg.data.heldout_fraction < 1.0,
        f"data.heldout_fraction is {cfg.data.heldout_fraction}; use a value in (0, 1).",
    )
    _require(t.eval_every >= 0 and t.eval_batches >= 1, "train.eval_every must be >= 0 and train.eval_batches >= 1.")
    _one_of("optim.name", o.name, ("adamw", "sgd"))
    _one_of("parallel.strategy", p.strategy, STRATEGIES)
    _one_of("parallel.sharding", p.sharding, SHARDINGS)
    _one_of("train.precision", t.precision, PRECISIONS)
    _one_of("train.fp8_recipe", t.fp8_recipe, FP8_RECIPES)
    _one_of("parallel.device", p.device, ("auto", "cpu", "cuda"))
    _one_of("parallel.backend", p.backend, ("auto", "gloo", "nccl"))
    _one_of("data.corpus", cfg.data.corpus, ("stdlib",))
    _require(p.timeout_s > 0, f"parallel.timeout_s is {p.timeout_s}; it must be positive.")
    check_values(cfg)  # the table of ranges, finiteness and cross-key rules (config/rules.py)
    g = cfg.guard
    _require(
        g.divergence_every >= 0
        and g.hang_factor > 1
        and g.hang_min_s > 0
        and g.tick_s > 0
        and g.hang_cap_s >= g.hang_min_s,
        "guard: divergence_every must be >= 0, hang_factor > 1, hang_min_s and tick_s > 0, "
        "and hang_cap_s >= hang_min_s.",
    )
    _require(
        g.check_steps >= 1 or g.check_steps == -1,
        f"guard.check_steps is {g.check_steps}; give the optimizer steps to check (>= 1), or -1 for every step.",
    )
    _check_checkpoint(cfg.checkpoint)
    d = cfg.data
    _require(
        d.num_workers >= 0,
        f"data.num_workers is {d.num_workers}; use 0 (load in the training "
        f"process) or a positive number of worker processes.",
    )
    _require(
        not d.persistent_workers or d.num_workers > 0,
        "data.persistent_workers = true needs data.num_workers > 0 (there are no workers to keep).",
    )
    check_elastic(cfg.elastic)
    check_log(cfg.log)
    check_sources(cfg)  # model.factory, data.factory, train.loss (config/user_code.py)
    check_data_source(cfg.data, "model.factory" if m.factory else "")
    builtin = not (m.factory or m.hf or m.hf_path)
    _require(
        not builtin or cfg.data.block_size <= m.block_size,
        f"config key 'data.block_size' is {cfg.data.block_size}, more than the built-in GPT's "
        f"model.block_size ({m.block_size}); lower data.block_size or leave it 0.",
    )
    _check_hardware(p)
    device = p.device if p.device != "auto" else ("cuda" if _cuda_count() else "cpu")
    # On CUDA it runs (NCCL aborted on a failure, elastic.fast_recovery) but says it is unproven.
    _require(
        not cfg.elastic.fast_recovery or p.strategy in FAST_RECOVERY_STRATEGIES,
        f"elastic.fast_recovery = true works with parallel.strategy 'ddp' or 'fsdp', not "
        f"{p.strategy!r} on {device}; set elastic.fast_recovery = false, or one of those strategies.",
    )
    validate_parallel(p, t.precision, world_size=p.nproc, local_world_size=p.nproc, device_type=device)
    _check_tp_options(cfg, builtin)
    check_fp8(t.precision, t.fp8_recipe, device)


def _check_tp_options(cfg: Config, builtin: bool) -> None:
    """The tensor-parallel checks that need the model and the loss: the built-in GPT's
    sizes, a TOML plan's entries, and sequence and loss parallel only where the built-in plan
    and loss run."""
    p, m = cfg.parallel, cfg.model
    options = [n for n, on in (("sequence_parallel", p.sequence_parallel), ("loss_parallel", p.loss_parallel)) if on]
    _require(
        builtin or not options,
        f"parallel.{options[0] if options else ''} = true extends the built-in GPT's plan, and this run's "
        f"model is its own (model.factory / hf / hf_path); set it false and put torch's styles in the "
        f"model's tp_plan instead.",
    )
    _require(
        not (p.loss_parallel and cfg.train.loss),
        f"parallel.loss_parallel = true needs the built-in loss (cross entropy on the split logits), but "
        f"train.loss is {cfg.train.loss!r}; drop train.loss, or set parallel.loss_parallel = false.",
    )
    check_tp_plan(p.tp_plan)
    _require(
        not (options and p.tp_plan),
        f"parallel.{options[0] if options else ''} = true extends the built-in GPT's plan, and parallel.tp_plan "
        f"replaces it; drop parallel.tp_plan, or set parallel.{options[0] if options else ''} = false.",
    )
    if builtin:
        check_gpt_tp(m.n_head, m.n_embd, p.tp, p.nproc)
        check_gpt_tp_options(
            p.tp,
            block_size=cfg.data.block_size or m.block_size,
            vocab_size=m.vocab_size,
            sequence_parallel=p.sequence_parallel,
            loss_parallel=p.loss_parallel,
        )


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_FSDP = ("fsdp", "fsdp1")


def validate_parallel(
    p: ParallelConfig, precision: str, *, world_size: int, local_world_size: int, device_type: str
) -> None:
    """Refuse strategy/option combinations that cannot work, naming the fix.

    Called by `validate` (world = parallel.nproc) and again by `wrap` with the real
    world. Raises `ConfigError`; never touches a process group.
    """
    s = p.strategy
    _one_of("parallel.strategy", s, STRATEGIES)
    _one_of("parallel.sharding", p.sharding, SHARDINGS)
    _one_of("train.precision", precision, PRECISIONS)
    _require(
        s in _FSDP or p.sharding == "full",
        f"parallel.sharding is {p.sharding!r}, but sharding modes apply only to strategy fsdp "
        f"or fsdp1 (strategy is {s!r}). Use --parallel.strategy=fsdp or drop the sharding key.",
    )
    _require(
        p.shard_group_size >= 0,
        f"parallel.shard_group_size is {p.shard_group_size}; use 0 (one node) or a positive group size.",
    )
    _require(
        p.shard_group_size == 0 or p.sharding == "hybrid",
        f"parallel.shard_group_size is set but parallel.sharding is {p.sharding!r}; the group "
        f"size applies only to --parallel.sharding=hybrid.",
    )
    _require(
        not p.cpu_offload or s in _FSDP,
        f"parallel.cpu_offload needs a sharding strategy (fsdp), but strategy is {s!r}: "
        f"{s} keeps every parameter on the device. Use --parallel.strategy=fsdp (P-FSDP-6).",
    )
    _require(
        not (p.static_graph or p.find_unused_parameters) or s in ("ddp", "zero1"),
        f"parallel.static_graph / find_unused_parameters are DDP options; strategy {s!r} "
        f"does not use them. Turn them off.",
    )
    _require(
        s != "dp" or world_size == 1,
        f"parallel.strategy 'dp' (DataParallel) runs in one process, but the job has "
        f"{world_size}; that would nest DataParallel inside DDP (P-DDP-1, P-DDP-3). Use "
        f"--parallel.nproc=1, or --parallel.strategy=ddp.",
    )
    _require(
        not (p.sync_batchnorm and s == "dp"),
        "parallel.sync_batchnorm needs one process per device; DataParallel's threads cannot "
        "synchronise statistics. Use --parallel.strategy=ddp (P-DDP-8).",
    )
    _require(
        precision != "fp8" or s in FP8_STRATEGIES,
        f"train.precision 'fp8' runs with parallel.strategy {', '.join(FP8_STRATEGIES)} (torchao's Float8 "
        f"training composes with those), not {s!r}; use one of them, or precision bf16.",
    )
    if s == "fsdp1":
        check_fsdp1(precision=precision, cpu_offload=p.cpu_offload, device_type=device_type)
    check_tp(s, p.tp, precision, world_size)
    check_tp_options(p.tp, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel)
    tp = max(1, p.tp)
    dp_local = max(1, local_world_size // tp)
    shard_grid(s, p.sharding, world_size // tp, shard_group_size=p.shard_group_size, local_world_size=dp_local)


def check_fsdp1(*, precision: str, cpu_offload: bool, device_type: str) -> None:
    """Raise `ConfigError` for a combination FSDP1 cannot run; each message names `fsdp`.

    - fp16: FSDP1 needs its own `ShardedGradScaler`; disttrain's agreed scaler
      serves FSDP2 only.
    - cpu_offload on a CPU job: `CPUOffload(offload_params=True)` fails there.
    """
    if precision == "fp16":
        raise ConfigError(
            "train.precision 'fp16' is not available with parallel.strategy 'fsdp1' "
            "(its gradients need FSDP1's own sharded grad scaler). Use "
            "--parallel.strategy=fsdp, or precision bf16/fp32."
        )
    if cpu_offload and device_type == "cpu":
        raise ConfigError(
            "parallel.cpu_offload with strategy 'fsdp1' fails on a CPU job "
            "(FSDP1 CPUOffload(offload_params=True) needs an accelerator). Use "
            "--parallel.strategy=fsdp, whose CPUOffloadPolicy runs on CPU."
        )


def shard_grid(
    strategy: str, sharding: str, world_size: int, *, shard_group_size: int = 0, local_world_size: int | None = None
) -> tuple[int, int]:
    """(replicas, shards) of the rank grid for a strategy and sharding mode; the
    arithmetic of `disttrain.parallel.Layout`, kept here so validation needs no torch.

    `shard_group_size=0` means one node's processes (`local_world_size`), the usual
    HSDP layout. Raises `ConfigError` when the group size does not divide the world,
    naming the sizes that would.
    """
    if strategy not in _FSDP or sharding == "none":
        return world_size, 1
    if sharding != "hybrid":
        return 1, world_size
    group = shard_group_size or local_world_size or world_size
    if group < 1 or world_size % group:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"parallel.shard_group_size is {group}, which does not divide the "
            f"world of {world_size} ranks; hybrid sharding needs equal shard "
            f"groups. Use one of {divisors}."
        )
    return world_size // group, group


def _check_hardware(p: ParallelConfig) -> None:
    """P-INIT-5: refuse a process count the devices cannot serve, before launch."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if p.device == "cuda" and gpus == 0:
        raise ConfigError(
            "parallel.device is 'cuda' but no CUDA device is visible. "
            "Use --parallel.device=cpu (or auto), or check CUDA_VISIBLE_DEVICES."
        )
    if p.device != "cpu" and gpus and p.nproc > gpus:
        raise ConfigError(
            f"parallel.nproc is {p.nproc} but only {gpus} GPU(s) are visible; "
            f"each process needs its own GPU (P-INIT-5). Set --parallel.nproc={gpus} "
            f"or make more devices visible with CUDA_VISIBLE_DEVICES."
        )
    if p.backend == "nccl" and (p.device == "cpu" or gpus == 0):
        raise ConfigError(
            "parallel.backend is 'nccl' but the job runs on CPU; NCCL needs CUDA. "
            "Use --parallel.backend=gloo (or auto)."
        )


def to_dict(cfg: Any) -> dict:
    """The resolved config as plain data (for the summary, the manifest, hashing)."""
    return dataclasses.asdict(cfg)
