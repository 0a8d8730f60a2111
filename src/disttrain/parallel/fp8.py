"""FP8 training (`precision="fp8"`): torchao's Float8 linear layers, the rest in bf16.

`apply_fp8` swaps each linear layer that `config.fp8_rules.converts` accepts for
torchao's `Float8Linear` (`torchao.float8.convert_to_float8_training`), in place,
before activation checkpointing, compile and sharding (torchtitan's order). A
`Float8Linear` keeps its weight as the same fp32 `Parameter`, so the state dict (names,
shapes, dtypes) is the unconverted model's: a checkpoint written under fp8 resumes under
bf16 and back. Its matmuls cast input, weight and output gradient to float8 on the fly,
with one dynamic scale per tensor ('tensorwise') or per row ('rowwise'); everything else
runs as under bf16 (`wrap` installs bf16 autocast, or FSDP2's bf16 policy). FSDP2's
all-gathers stay bf16 (torchao's float8 all-gather is not used).

torchao is imported here only, when fp8 is asked for; `import disttrain` never needs it.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.nn as nn

from disttrain.config.fp8_rules import INSTALL, converts, embedding_weight_ids, emulated
from disttrain.errors import UserError
from disttrain.runtime.log import LOGGER, speaker

_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers quieted while torchao is imported: it logs each of its CUDA extension libraries
that this torch build cannot load (none is one Float8 training uses), and torch warns on
every rank that torchao registers an enum the old way."""


def _float8():
    """torchao.float8, or a `UserError` naming the install command."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise UserError(f"precision 'fp8' trains through torchao, which cannot be imported ({e}): {INSTALL}.") from None
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return float8


def apply_fp8(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    """Convert `model`'s eligible linear layers to torchao's `Float8Linear` with the
    scaling `recipe` ('tensorwise' or 'rowwise'), in place, and return `model` (a bare
    eligible `nn.Linear` comes back as a new `Float8Linear`).

    Under `DISTTRAIN_FP8_EMULATE=1` torchao emulates the FP8 matmul (tests, dry runs).
    A model with no eligible layer trains as under bf16, with one warning. Raises
    `UserError` when torchao cannot be imported.
    """
    float8 = _float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if emulated():
        config = dataclasses.replace(config, emulate=True)
    tied = embedding_weight_ids(model)
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if converts(module, fqn, embedding_weights=tied):
            converted.append(fqn)
            return True
        return False

    model = float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if not converted:
        LOGGER.warning(
            f"{speaker()}: precision 'fp8' found no nn.Linear with both dimensions multiples of 16, so "
            f"the model trains as under bf16; use precision 'bf16', or give it such layers."
        )
    return model
