"""What FP8 training (`train.precision = "fp8"`) accepts: devices, layers, recipes.

One place for the rules that the launcher's validation, `dt.wrap` and the planner must
agree on:

- a device: a CUDA GPU of compute capability 8.9 or higher (Ada and Hopper on: L4,
  L40S, RTX 4090, H100, H200), where torch's scaled matmul has FP8 kernels. The CPU
  and older GPUs are refused in one line that names the fix. `DISTTRAIN_FP8_EMULATE=1`
  lifts the refusal and runs torchao's emulation (the FP8 casts are real, the matmul
  runs in high precision): for tests and dry runs on the CPU, never for speed.
- a layer: an `nn.Linear` (the class itself, not a subclass with its own forward)
  whose in and out features are both multiples of 16 (the FP8 matmul's requirement)
  and whose weight is not an embedding's (a tied LM head keeps its logits in bf16).
  Everything else computes in bf16.
- torchao (`pip install 'disttrain[fp8]'`), found here without importing it.

torch is imported inside the functions: `disttrain.config` stays torch-free at import.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from disttrain.errors import ConfigError

FP8_RECIPES = ("tensorwise", "rowwise")
"""torchao's scaling recipes: one scale per tensor (the default, fastest), or one per row."""
MIN_CAPABILITY = (8, 9)
EMULATE_ENV = "DISTTRAIN_FP8_EMULATE"
INSTALL = "pip install 'disttrain[fp8]' (torchao>=0.18)"
_GPUS = "a CUDA GPU of compute capability 8.9 or higher (H100, H200, L4, L40S, RTX 4090)"


def emulated() -> bool:
    """Whether `DISTTRAIN_FP8_EMULATE=1` asks for torchao's emulation (tests, dry runs)."""
    return os.environ.get(EMULATE_ENV) == "1"


def check_fp8_device(device_type: str, device_index: int | None = None, *, capability: Callable | None = None) -> None:
    """Raise `ConfigError` (one line, naming the fix) when FP8 training cannot run on
    `device_type`: the CPU, or a CUDA device of compute capability below 8.9.

    `device_index`: that CUDA device (a rank's own); None: every visible one (the
    launcher, before it starts a rank on each). `capability` replaces
    `torch.cuda.get_device_capability`. Passes anything under `DISTTRAIN_FP8_EMULATE=1`.
    """
    if emulated():
        return
    if device_type != "cuda":
        raise ConfigError(
            f"train.precision 'fp8' needs {_GPUS}; this job runs on the {device_type.upper()}. "
            f"Use train.precision = 'bf16', or run on such a GPU."
        )
    import torch

    get = capability or torch.cuda.get_device_capability
    indices = [device_index] if device_index is not None else list(range(torch.cuda.device_count()))
    for index in indices:
        major, minor = get(index)
        if (major, minor) < MIN_CAPABILITY:
            raise ConfigError(
                f"train.precision 'fp8' needs {_GPUS}; cuda:{index} has compute capability "
                f"{major}.{minor}. Use train.precision = 'bf16' there, or run on such a GPU."
            )


def check_torchao() -> None:
    """Raise `ConfigError` naming the install command when torchao is not installed."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"train.precision 'fp8' trains through torchao, which is not installed: {INSTALL}; "
            f"or use train.precision = 'bf16'."
        )


def check_fp8(precision: str, recipe: str, device_type: str, device_index: int | None = None) -> None:
    """Every FP8 refusal in one call: a no-op unless `precision` is 'fp8'; then an unknown
    recipe, the device (`check_fp8_device`) and a missing torchao, each a `ConfigError`."""
    if precision != "fp8":
        return
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"config key 'train.fp8_recipe' is {recipe!r}; choose one of {', '.join(FP8_RECIPES)}.")
    check_fp8_device(device_type, device_index)
    check_torchao()


def converts(module: Any, fqn: str = "", *, embedding_weights: frozenset[int] = frozenset()) -> bool:
    """Whether FP8 training converts `module` (see the module docstring): a plain
    `nn.Linear` with both dimensions multiples of 16 whose weight is not in
    `embedding_weights` (ids of the model's embedding weights). The signature is
    torchao's `module_filter_fn` once `embedding_weights` is bound."""
    import torch.nn as nn

    if type(module) is not nn.Linear:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0 and id(module.weight) not in embedding_weights


def embedding_weight_ids(model: Any) -> frozenset[int]:
    """Ids of the weights of `model`'s `nn.Embedding` layers (what a tied head shares)."""
    import torch.nn as nn

    return frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))


def fp8_linear_shapes(model: Any) -> list[tuple[int, int]]:
    """(out_features, in_features) of every layer FP8 training would convert in `model`
    (works on the meta device: only shapes are read)."""
    tied = embedding_weight_ids(model)
    return [(m.out_features, m.in_features) for m in model.modules() if converts(m, embedding_weights=tied)]
