"""`wrap(model, ...)`: one entry point for every data-parallel strategy.

Each strategy is a plain function `apply_x(model, ...)` in its own module:

    ddp    ddp.apply_ddp         DistributedDataParallel
    zero1  zero.apply_zero1      DDP + ZeroRedundancyOptimizer (via make_optimizer)
    fsdp   fsdp.apply_fsdp       FSDP2 fully_shard per block, on a mesh from mesh.Layout
    tp     tensor_parallel.apply_tp   with fsdp or ddp: layers split over a TP group first
           (loss_parallel.install: the loss on logits split over the vocabulary)
    fsdp1  fsdp1.apply_fsdp1     legacy FullyShardedDataParallel
    dp     dp.apply_dp           nn.DataParallel (one process)

`wrap` validates the request (`config.validate_parallel`, and for fp8
`config.fp8_rules`), moves the model to this rank's device, converts its linear
layers to FP8 (precision fp8, `fp8.apply_fp8`), converts BatchNorm (sync_batchnorm),
splits the planned layers over the TP group (`tp` > 1), applies activation
checkpointing and the strategy in that order, installs the
precision, and switches the RNGs to the per-rank stream. Build the optimizer
afterwards, from the returned module (`make_optimizer`; P-DDP-3, P-FSDP-7).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from disttrain.config import STRATEGIES, ParallelConfig, validate_parallel
from disttrain.config.fp8_rules import check_fp8
from disttrain.errors import ConfigError, UserError
from disttrain.parallel.blocks import apply_activation_checkpointing, find_blocks
from disttrain.parallel.compile import check_compile, compile_blocks, plain_module
from disttrain.parallel.ddp import apply_ddp
from disttrain.parallel.dp import apply_dp
from disttrain.parallel.fp8 import apply_fp8
from disttrain.parallel.join import join
from disttrain.parallel.mesh import Layout
from disttrain.parallel.optimizers import WRAP_INFO, apply_zero1, check_optimizer, make_optimizer, wrap_info
from disttrain.parallel.precision import apply_autocast, compute_precision
from disttrain.parallel.syncbn import convert_sync_batchnorm
from disttrain.runtime import rank_info, seed_rank_stream
from disttrain.runtime.torch_compat import unwrap, wrapper_kind

__all__ = ["Layout", "check_optimizer", "join", "make_optimizer", "unwrap", "wrap", "wrap_info"]


def _is_fsdp2(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _parallel_config(cfg: ParallelConfig | None, overrides: dict) -> ParallelConfig:
    cfg = dataclasses.replace(cfg or ParallelConfig(), **{})
    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    for key, value in overrides.items():
        if key not in names:
            options = ", ".join(["precision", "compile", "fp8_recipe", "tp_plan", *sorted(names)])
            raise ConfigError(f"wrap() got an unknown option {key!r}; valid options: {options}.")
        setattr(cfg, key, value)
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"strategy {cfg.strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}.")
    return cfg


_DATA_PARALLEL = ("ddp", "dp", "fsdp1")
"""Wrapper kinds that replicate or shard (`torch_compat.wrapper_kind`); compile and the
checkpoint wrapper nest with them."""


def _refuse_nested(model: nn.Module) -> None:
    # P-DDP-3: DataParallel in DDP (or any wrapper in another) replicates twice.
    for name, sub in model.named_modules():
        if wrapper_kind(sub) in _DATA_PARALLEL or _is_fsdp2(sub) or hasattr(sub, WRAP_INFO):
            where = f"its submodule {name!r} is" if name else "it is"
            raise UserError(
                f"the model is already wrapped ({where} a {type(sub).__name__}); "
                f"wrapping it again nests data parallelism (P-DDP-3). Pass the plain "
                f"module to dt.wrap() once."
            )


def wrap(
    model: nn.Module,
    cfg: ParallelConfig | None = None,
    *,
    precision: str = "fp32",
    compile: bool | dict = False,
    fp8_recipe: str = "tensorwise",
    tp_plan: Mapping[str, object] | None = None,
    **options,
) -> nn.Module:
    """Apply the configured strategy and return the module to train.

    `options` override fields of `cfg` (for example `strategy="fsdp"`,
    `sharding="hybrid"`, `shard_group_size=2`). `precision` is 'fp32', 'bf16',
    'fp16' (pair fp16 with `precision.make_grad_scaler`) or 'fp8' (torchao's Float8
    linear layers with `fp8_recipe` 'tensorwise' or 'rowwise' scaling, the rest bf16;
    strategies ddp, zero1 and fsdp on a GPU of compute capability 8.9 or higher,
    docs/strategies.md "FP8"; the state dict stays the plain model's). `compile=True` compiles
    each block in place after activation checkpointing and before sharding
    (`parallel.compile`; state-dict keys unchanged); a dict compiles with those
    `torch.compile` options (`{"backend": "aot_eager"}`); a `torch.compile(model)` wrapper
    is unwrapped and compiled the same way. `tp=N` splits the layers of `tp_plan`
    (`{"blocks.*.attn.q": "colwise", ...}`: 'colwise', 'rowwise', 'sequence' or torch
    `ParallelStyle`s; None: the model's own `tp_plan`) over N consecutive ranks with
    torch's `parallelize_module`, then the strategy (fsdp, or ddp when N is the world)
    spans the world / N data-parallel ranks; a degree that does not divide the world or
    a planned layer is a `UserError` naming the degrees that work. With N > 1,
    `sequence_parallel=True` and `loss_parallel=True` extend the model's own plan
    (`tp_plan_for`, the built-in GPT's): the norms on a slice of the sequence, and the
    loss on logits split over the vocabulary (the forward runs under torch's
    `loss_parallel()` and returns the logits as that DTensor and the loss as a plain
    tensor whose backward enters the context again by itself). In a world of 1 every
    strategy except `dp` leaves the module unwrapped (no process group exists);
    precision, SyncBN conversion and activation checkpointing still apply.
    A collective when the world is larger: every rank calls it with the same
    arguments. Raises `UserError` for a model that is already wrapped (nested
    wrapping, P-DDP-3) and `ConfigError` for an unknown option or an illegal
    combination (compile with dp, fsdp1 or cpu_offload included), before anything
    is changed.
    """
    cfg = _parallel_config(cfg, options)
    info = rank_info()
    device_type = info.device.type
    validate_parallel(
        cfg, precision, world_size=info.world_size, local_world_size=info.local_world_size, device_type=device_type
    )
    check_fp8(precision, fp8_recipe, device_type, info.device.index)
    model, was_compiled = plain_module(model)
    compile_options = compile if isinstance(compile, dict) else {}
    compile = bool(compile) or isinstance(compile, dict) or was_compiled
    if compile:
        check_compile(cfg.strategy, cpu_offload=cfg.cpu_offload)
    _refuse_nested(model)
    model = model.to(info.device)
    if precision == "fp8":
        model = apply_fp8(model, fp8_recipe)
    compute = compute_precision(precision)  # fp8: the layers it does not convert run in bf16
    if cfg.sync_batchnorm:
        model = convert_sync_batchnorm(model, device_type)
    layout = Layout.for_strategy(
        cfg.strategy,
        cfg.sharding,
        info.world_size,
        shard_group_size=cfg.shard_group_size,
        local_world_size=info.local_world_size,
        device_type=device_type,
        tp=cfg.tp,
    )
    if cfg.tp > 1:  # before checkpointing and sharding: the plan names the plain modules
        # imported here: torch's tensor-parallel package pulls in DTensor and sympy, which
        # a run without tp never needs at start-up (tests/launch/test_imports_startup.py)
        from disttrain.parallel.tensor_parallel import apply_tp

        model = apply_tp(
            model,
            layout.tp_mesh(),
            tp_plan,
            world_size=info.world_size,
            sequence_parallel=cfg.sequence_parallel,
            loss_parallel=cfg.loss_parallel,
        )
        if cfg.loss_parallel:
            from disttrain.parallel.loss_parallel import install

            install(model)
    sharded = cfg.strategy in ("fsdp", "fsdp1") and info.world_size > 1
    if not sharded and (cfg.activation_checkpointing or compile):
        # torchtitan's order: checkpointing, then compile per block, then DDP
        blocks = find_blocks(model, cfg.wrap)
        if cfg.activation_checkpointing:
            blocks = apply_activation_checkpointing(model, blocks)
        if compile:
            compile_blocks(model, blocks, **compile_options)
    ddp_options: dict[str, Any] = dict(
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=cfg.find_unused_parameters,
    )
    mesh = None
    if cfg.strategy == "dp":
        model = apply_dp(model, info.world_size)
    elif info.world_size == 1 or (cfg.strategy == "ddp" and cfg.tp > 1):  # ddp only at tp = world
        pass
    elif cfg.strategy == "ddp":
        model = apply_ddp(model, info.device, **ddp_options)
    elif cfg.strategy == "zero1":
        model = apply_zero1(model, info.device, **ddp_options)
    elif cfg.strategy == "fsdp":
        mesh = layout.build_mesh()
        from disttrain.parallel.fsdp import apply_fsdp

        model = apply_fsdp(
            model,
            mesh,
            sharding=cfg.sharding,
            wrap=cfg.wrap,
            precision=compute,
            cpu_offload=cfg.cpu_offload,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=compile_options if compile_options else compile,
        )
    elif cfg.strategy == "fsdp1":
        from disttrain.parallel.fsdp1 import apply_fsdp1

        model = apply_fsdp1(
            model,
            layout,
            info.device,
            sharding=cfg.sharding,
            wrap=cfg.wrap,
            precision=precision,
            cpu_offload=cfg.cpu_offload,
            activation_checkpointing=cfg.activation_checkpointing,
        )
    if not sharded:
        # Replicated strategies compute under autocast; FSDP casts via its own policy.
        apply_autocast(model, compute, device_type)
    setattr(
        model,
        WRAP_INFO,
        {
            "strategy": cfg.strategy,
            "precision": precision,
            "compile": compile,
            "world_size": info.world_size,
            "layout": layout,
            "mesh": mesh,
            "tp": cfg.tp,
        },
    )
    # The ranks of one TP group compute on the same activations: one dropout stream.
    seed_rank_stream(dataclasses.replace(info, rank=info.rank // layout.tp))
    return model
