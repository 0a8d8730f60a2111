"""`torch.compile` per block, before sharding: `wrap(model, compile=True)` and
`train.compile = true`.

Order, as in torchtitan's parallelize: activation checkpointing wraps each block,
then each block is compiled, then FSDP shards each block and the root (or DDP wraps
the whole). Compiling per block, not the whole model, means one graph that every
block reuses (the blocks are alike), and the collectives of FSDP and DDP stay outside
the compiled graphs, in their hooks.

Each block is compiled in place (`nn.Module.compile`), not wrapped in an
`OptimizedModule`: parameter names and state-dict keys stay the same
(no `_orig_mod.`), so a checkpoint of a compiled run loads into an eager model and
back. A model with no blocks (no `_no_split_modules`, or `parallel.wrap = "model"`)
is compiled whole, in place.

Refused, one line each (`check_compile`): `dp` (DataParallel replicates the module
into threads on every forward) and `fsdp1` (its flat parameters need
`use_orig_params` with compile, which disttrain's FSDP1 does not set); `cpu_offload`
(the optimizer steps on the host while the graphs are traced for the device, untested
here).
"""

from __future__ import annotations

import torch.nn as nn

from disttrain.errors import ConfigError
from disttrain.runtime import torch_compat

_REFUSED = {
    "dp": "DataParallel copies the module into a thread per device on every forward, so "
    'compiled code is traced again each step; use parallel.strategy = "ddp"',
    "fsdp1": "FSDP1 flattens the parameters of each unit, which compile sees only with "
    'use_orig_params; use parallel.strategy = "fsdp" (FSDP2)',
}


def check_compile(strategy: str, *, cpu_offload: bool = False) -> None:
    """Raise `ConfigError` (one line naming the fix) for a combination that compile
    does not support: strategy dp or fsdp1, or parallel.cpu_offload."""
    if strategy in _REFUSED:
        raise ConfigError(
            f"train.compile = true does not work with parallel.strategy {strategy!r}: "
            f"{_REFUSED[strategy]}, or set train.compile = false."
        )
    if cpu_offload:
        raise ConfigError(
            "train.compile = true with parallel.cpu_offload = true is not supported (the "
            "offloaded optimizer steps on the host outside the compiled graphs, untested); "
            "set one of them to false."
        )


def plain_module(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module inside a `torch.compile(model)` wrapper, whether it was one). Its
    keys carry `_orig_mod.`; `wrap` takes the inner module and compiles per block."""
    if torch_compat.wrapper_kind(model) != "compile":
        return model, False
    # One layer only: a compiled DDP model then reaches wrap's nested-wrapper refusal.
    return torch_compat.inner_module(model) or model, True


def compile_blocks(model: nn.Module, blocks: list[nn.Module], **options) -> list[nn.Module]:
    """Compile each of `blocks` in place (`nn.Module.compile(**options)`), or `model`
    itself when `blocks` is empty, and return what was compiled. Nothing is traced
    until the first forward. Call it after activation checkpointing and before
    sharding; names and state-dict keys do not change."""
    targets = list(blocks) or [model]
    for module in targets:
        module.compile(**options)
    return targets


def is_compiled(module: nn.Module) -> bool:
    """True when `module` (or, for a model compiled per block, one of its submodules)
    runs compiled code."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())
