"""What the loop does with one batch, for both ways in: moved to the rank's device,
passed to the model as its structure says (a dict as keywords, a tuple as positions),
and the loss found in the output. A batch the model rejects at the first forward, or a
loss that is not a scalar tensor, is one `UserError` naming the batch's structure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from disttrain.errors import UserError
from disttrain.runtime import torch_compat


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a nested dict / tuple / list batch moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuple
    return batch


def describe(batch: Any) -> str:
    """A short structure of a batch: dict keys, tuple arity, tensor shapes and dtypes."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{tuple(batch.shape)} {str(batch.dtype).replace('torch.', '')}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        inner = ", ".join(describe(v) for v in batch)
        return f"({inner})" if isinstance(batch, tuple) else f"[{inner}]"
    return type(batch).__name__


def forward(model: torch.nn.Module, batch: Any) -> Any:
    """`model(**batch)` for a dict, `model(*batch)` for a tuple or list, else `model(batch)`."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def output_loss(output: Any) -> Any:
    """The loss in a model's output: the output itself (a tensor), `output.loss`
    (a Hugging Face ModelOutput), or the last element of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output:
        return output[-1]
    return output


def batch_loss(
    model: torch.nn.Module, batch: Any, loss_fn: Callable | None, *, first: bool = False, data: str = "data.factory"
) -> torch.Tensor:
    """The scalar loss of one batch: `loss_fn(model, batch)` when train.loss is set, else
    the loss in `forward(model, batch)`'s output (`output_loss`).

    `first=True` (the first forward of the run) turns an exception into a `UserError`
    naming the batch's structure, the model and `data` (the config key of the samples).
    Raises `UserError` when the loss is not
    a scalar tensor."""
    name = type(torch_compat.unwrap(model)).__name__
    try:
        loss = loss_fn(model, batch) if loss_fn is not None else output_loss(forward(model, batch))
    except Exception as e:
        if not first:
            raise
        how = (
            "train.loss(model, batch)"
            if loss_fn is not None
            else (
                "model(**batch)"
                if isinstance(batch, dict)
                else "model(*batch)"
                if isinstance(batch, (tuple, list))
                else "model(batch)"
            )
        )
        raise UserError(
            f"the first batch failed in {how}: model {name} raised {type(e).__name__}: "
            f"{e}. The batch is {describe(batch)}. Make {data}'s samples match "
            f"the model's forward arguments (a dict's keys are passed as keyword "
            f'arguments), or set train.loss = "module:fn".'
        ) from e
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = describe(loss) if isinstance(loss, (torch.Tensor, tuple, list, dict)) else type(loss).__name__
        src = "train.loss" if loss_fn is not None else f"model {name}'s output"
        raise UserError(
            f"the loss from {src} is {what}, not a scalar tensor. Return the loss as "
            f"the output, as `output.loss`, or as the last element of a tuple; or set "
            f'train.loss = "module:fn" with fn(model, batch) -> scalar tensor.'
        )
    return loss
