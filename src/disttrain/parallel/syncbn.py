"""SyncBatchNorm on every device, gloo included (P-DDP-8).

BatchNorm normalises with the statistics of the batch it sees. Under data
parallelism that is the per-rank batch, so small per-device batches give noisy
statistics and per-rank running stats drift apart. DDP's `broadcast_buffers=True`
only copies rank 0's running stats to the others before each forward: it hides the
drift in the buffers but the normalisation itself still used local statistics.
SyncBatchNorm computes the statistics over the global batch instead, so N ranks
normalise exactly like one process on the whole batch.

torch's `nn.SyncBatchNorm` refuses CPU tensors. On CUDA disttrain converts to it;
on CPU it converts to `GlooSyncBatchNorm`, which computes the same global
statistics with one differentiable all-reduce of (sum, sum of squares, count).
Either way the statistics communicate in every forward, `no_sync` included.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn

from disttrain.runtime import torch_compat


class GlooSyncBatchNorm(torch_compat.batchnorm_base()):  # type: ignore[misc]  # torch's base, found at run time
    """BatchNorm over the global batch of all ranks, for any device and backend.

    Training: mean and variance come from an all-reduce of per-channel sums, whose
    backward all-reduces the gradients (the exact gradient of global statistics).
    Running stats are updated with the unbiased global variance, as BatchNorm does.
    Eval, or a world of 1: plain BatchNorm.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        sync = self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not sync:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.size(1)], dtype=torch.float32, device=x.device)
        stats = torch.cat([x.float().sum(dims), (x.float() ** 2).sum(dims), count])
        stats = dist_fn.all_reduce(stats)  # differentiable: backward all-reduces the grads
        c = x.size(1)
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c : 2 * c] / n - mean**2
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * n / max(float(n) - 1, 1.0), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape).to(x.dtype)) * torch.rsqrt(var.view(shape) + self.eps).to(x.dtype)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(model: nn.Module, device_type: str) -> nn.Module:
    """Replace every BatchNorm*d in `model` by a synchronised one and return the model.

    CUDA (and other accelerators torch supports): `nn.SyncBatchNorm`. CPU:
    `GlooSyncBatchNorm`. Parameters and buffers are carried over unchanged. Call
    before wrapping: the converted layers must be what DDP/FSDP registers.
    """
    if device_type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, torch_compat.batchnorm_base()) and not isinstance(module, GlooSyncBatchNorm):
        out = GlooSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        if module.track_running_stats:
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, torch_compat.batchnorm_base()) for m in model.modules())
