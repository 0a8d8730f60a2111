"""DistributedDataParallel with disttrain's defaults (P-DDP-2,3,4,6).

Parameters and buffers are broadcast from rank 0 at construction; gradients are
all-reduced in buckets while backward runs, then averaged by the world size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.errors import UserError

_UNUSED_PARAMS_HELP = (
    "DDP found parameters that received no gradient in the previous step "
    '("Expected to have finished reduction in the prior iteration", P-DDP-4).\n'
    "Cause: some parameters did not take part in computing the loss (a branch that was "
    "skipped, an unused head, or outputs left out of the loss).\n"
    "Fix, one of:\n"
    "  1. make every parameter contribute to the loss in every step (or freeze the unused "
    "ones with requires_grad=False before wrapping); or\n"
    "  2. set parallel.find_unused_parameters = true (costs about 10-20% throughput).\n"
    "Set TORCH_DISTRIBUTED_DEBUG=DETAIL to see which parameters were unused."
)


class ExplainedDDP(DistributedDataParallel):
    """DDP whose best-known failure is re-raised with its cause and both fixes."""

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if "Expected to have finished reduction" in str(e):
                raise UserError(_UNUSED_PARAMS_HELP) from e
            raise


def apply_ddp(
    model: nn.Module,
    device: torch.device,
    *,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = True,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    process_group=None,
) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) in DDP. Build the optimizer afterwards.

    `device_ids` is set only for one-GPU-per-process jobs, as DDP requires (P-DDP-3).
    """
    if static_graph and find_unused_parameters:
        # static_graph already handles a fixed unused set; both together is a config mistake.
        raise UserError(
            "parallel.static_graph and parallel.find_unused_parameters are both on; "
            "static_graph already handles a fixed set of unused parameters. "
            "Turn one off."
        )
    return ExplainedDDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
        process_group=process_group,
    )
