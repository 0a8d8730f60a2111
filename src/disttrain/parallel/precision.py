"""Mixed precision: autocast for replicated strategies, and an fp16 grad scaler whose
skip decision every rank shares (P-DDP-7, P-FSDP-5).

- bf16 needs no scaler. Under DDP / ZeRO-1 / DataParallel the model's forward runs
  under `torch.autocast` (installed by `wrap` as forward hooks); parameters and
  the gradient all-reduce stay fp32. Under FSDP the `MixedPrecisionPolicy` casts
  parameters to bf16 and reduces gradients in fp32 instead.
- fp8 (`parallel/fp8.py`) runs torchao's Float8 matmuls in the linear layers it
  converts and everything else as bf16 above (no scaler).
- fp16 needs a loss scaler. torch's `GradScaler` decides per rank whether a step
  had inf/nan gradients. When only one rank sees an overflow (a sharded gradient,
  or a gradient touched after the all-reduce), that rank skips the step and halves
  its scale while the others step: the replicas diverge silently. `AgreedGradScaler`
  all-reduces the found-inf flag (MAX) before deciding, so every rank skips the
  same steps and keeps the same scale.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from disttrain.errors import UserError
from disttrain.runtime import torch_compat

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8_REST = "bf16"
"""What fp8 computes in outside the layers it converts."""


def compute_precision(precision: str) -> str:
    """The autocast / FSDP precision of `precision`: itself, or 'bf16' for 'fp8'."""
    return FP8_REST if precision == "fp8" else precision


def autocast(precision: str, device_type: str = "cpu"):
    """A context that runs the ops inside it in `precision` on `device_type` devices.

    'bf16' and 'fp16' are `torch.autocast` with that dtype, 'fp8' the bf16 one (what
    fp8 runs outside its converted linear layers); 'fp32' is a null context.
    `dt.wrap(precision=...)` already runs the model's forward this way; use this for
    code outside the model (a loss, an evaluation). Another precision name is a
    `UserError` naming the four.
    """
    precision = compute_precision(precision)
    if precision not in DTYPES:
        raise UserError(f"precision {precision!r} is not one of {', '.join(map(repr, DTYPES))}, 'fp8'.")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision])


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple):
        return tuple(_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def apply_autocast(model: nn.Module, precision: str, device_type: str) -> nn.Module:
    """Run `model`'s forward under autocast, and return floating outputs in fp32.

    Installed as a forward pre-hook that enters autocast and a forward hook with
    `always_call=True` that leaves it, so an exception inside forward cannot leave
    autocast switched on. fp32 outputs keep a loss computed outside the model
    accurate. A no-op for fp32. Returns `model`.
    """
    if precision == "fp32":
        return model
    active: list = []

    def enter(module, args):
        ctx = autocast(precision, device_type)
        ctx.__enter__()
        active.append(ctx)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)
        return _to_fp32(output)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return model


def _local(grad: torch.Tensor) -> torch.Tensor:
    # A DTensor gradient (FSDP2) is scaled through its local shard, in place.
    return grad.to_local() if hasattr(grad, "to_local") else grad


class AgreedGradScaler:
    """Dynamic loss scaling for fp16 whose step/skip decision is global.

    Same protocol as `torch.amp.GradScaler` (`scale`, `unscale_`, `step`, `update`,
    `get_scale`, `state_dict`), so `loop.Accumulator(scaler=...)` drives it.
    `unscale_` is a collective: it all-reduces one flag over `process_group`
    (default: all ranks), so every rank must call it at the same step. Contract:
    if any rank finds an inf or nan in its gradients, every rank skips that
    optimizer step and multiplies the scale by `backoff_factor`; otherwise every
    rank steps, and after `growth_interval` clean steps the scale grows. The scale
    is therefore identical on all ranks at all times.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        process_group=None,
    ):
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.process_group = growth_interval, process_group
        self._growth_tracker = 0
        self._found_inf: dict[int, bool] = {}
        self.skipped_steps = 0
        """Optimizer steps skipped because some rank overflowed (the same on every rank)."""

    def get_scale(self) -> float:
        """The current loss scale, the same on every rank."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` multiplied by the current scale; call backward on the result."""
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by the scale; return whether any rank overflowed."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update().")
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, device=device)
        # torch's fused unscale + non-finite check, one call per (device, dtype): no host
        # sync per parameter; the single sync is the `.item()` below.
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            if g.numel():
                buckets.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), bucket in buckets.items():
            found_here = torch.zeros(1, device=dev)
            inv = torch.full((1,), 1.0 / self._scale, device=dev)
            torch_compat.unscale_and_check_(bucket, found_here, inv)
            found = torch.maximum(found, found_here.to(device))
        if dist.is_available() and dist.is_initialized():
            # The agreement: any rank's overflow becomes every rank's overflow.
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        self._found_inf[id(optimizer)] = bool(found.item())
        return self._found_inf[id(optimizer)]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless some rank overflowed. Returns True when the step ran."""
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale from this step's (global) outcome."""
        if any(self._found_inf.values()):
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf.clear()

    def state_dict(self) -> dict:
        """Everything a resume needs (P-CKPT-1)."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scale, growth tracker and skipped-step count of `state_dict()`."""
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def make_grad_scaler(precision: str) -> AgreedGradScaler | None:
    """The scaler a precision needs: a new `AgreedGradScaler` for 'fp16', else None.

    Pass the result to `dt.Accumulator(scaler=...)` or `job.resume(scaler=...)`;
    neither makes one by itself, and fp16 without loss scaling loses small
    gradients. bf16, fp8 and fp32 need none. Not a collective.
    """
    return AgreedGradScaler() if precision == "fp16" else None
