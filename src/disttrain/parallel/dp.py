"""`nn.DataParallel`: one process driving every visible GPU with threads (P-DDP-1).

Kept for comparison and tiny single-node jobs. Each forward copies the parameters
to every GPU, scatters the batch, runs one thread per GPU (bounded by the GIL) and
gathers the outputs on device 0, so DDP (one process per device) is faster: 3.6x vs
2.3x on 4 GPUs in the measurement cited by docs/practices.md. DataParallel is never
nested inside DDP (P-DDP-3): `dp` runs only in a world of one process.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from disttrain.errors import ConfigError
from disttrain.runtime import processes


def apply_dp(model: nn.Module, world_size: int) -> nn.DataParallel:
    """Wrap `model` (already on cuda:0 or the CPU) in `nn.DataParallel` and return it.

    With CUDA it replicates over every visible GPU. Without CUDA, DataParallel calls
    the module directly: the job is a world of 1, and a warning says so once per
    process. Raises `ConfigError` when started in a multi-process job, which would
    nest DataParallel inside data-parallel processes.
    """
    if world_size > 1:
        raise ConfigError(
            f"parallel.strategy 'dp' runs in one process, but this job has "
            f"{world_size} processes (DataParallel inside DDP, P-DDP-3). Launch "
            f"with --parallel.nproc=1, or use --parallel.strategy=ddp."
        )
    if not torch.cuda.is_available() and processes.first_time("dp on the CPU"):
        warnings.warn(
            "parallel.strategy 'dp' without CUDA runs as a world of 1 on the CPU; "
            "DataParallel only helps with several GPUs. Use 'ddp' for multi-process "
            "training (P-DDP-1).",
            stacklevel=3,
        )
    return nn.DataParallel(model)
