"""One optimizer step's window: gradient accumulation with `no_sync`, the loss scaled
once, global-norm clipping and the step of the optimizer, its scheduler and grad scaler
(`Accumulator`); and the LR schedule that counts those steps (`warmup_cosine`)
(P-DDP-5, P-LOOP-4,5).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn

from disttrain.parallel.optimizers import check_optimizer
from disttrain.runtime.collectives import assert_same_across_ranks


def no_sync(model: nn.Module):
    """A context in which backward does not communicate gradients.

    Gradients accumulate locally inside it; the next backward outside it
    synchronises the sum (use it for every micro-batch of an accumulation window but
    the last; `dt.Accumulator` does this for you). DDP: `model.no_sync()`. FSDP2:
    gradient sync switched off for the duration and switched back on when the block
    leaves, on every path. Other modules (a world of 1): a null context. Not a
    collective; never raises.
    """
    if hasattr(model, "no_sync"):
        return getattr(model, "no_sync")()  # noqa: B009  (DDP's; nn.Module types its attributes as tensors)
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp2_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip to the global gradient norm and return the norm before clipping (P-LOOP-5).

    The norm is over all of the model's gradients on every rank, so every rank
    scales by the same factor. FSDP1 modules use their own sharding-aware
    `clip_grad_norm_`; DTensor gradients (FSDP2) are handled by torch's
    `clip_grad_norm_`, which reduces across shards (under tensor parallelism, per
    device mesh, then combined): a collective under a sharded strategy, every rank
    calls it. A non-finite norm (an overflow) is returned as is
    and leaves the gradients unusable; check it before stepping when the loss can
    overflow (under fp16 the `AgreedGradScaler` skips such a step on every rank).
    """
    if hasattr(model, "clip_grad_norm_"):
        norm = getattr(model, "clip_grad_norm_")(max_norm)  # noqa: B009  (FSDP1's own)
    elif len(groups := _by_mesh(model)) > 1:
        return _clip_by_mesh(groups, max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _by_mesh(model: nn.Module) -> list[list[torch.Tensor]]:
    """The gradients, grouped by the device mesh they are spread over (None: plain)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    return list(groups.values())


@torch.no_grad()
def _clip_by_mesh(groups: list[list[torch.Tensor]], max_norm: float) -> float:
    # Tensor parallel x FSDP spreads the planned layers' gradients over the 2D mesh and
    # the others over the data-parallel one (or none); torch's clip needs one mesh.
    squares = 0.0
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads)
        squares += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    total = math.sqrt(squares)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for grads in groups:
            for g in grads:
                g.mul_(coef)
    return total


class Accumulator:
    """Gradient accumulation that communicates once per optimizer step (P-DDP-5).

    Use::

        acc = Accumulator(model, optimizer, accum_steps=4, scheduler=sched, grad_clip=1.0)
        for x, y in loader:
            with acc.micro_step(last=is_last_batch):
                _, loss = model(x, y)
                acc.backward(loss)

    Non-boundary micro-steps run under `no_sync`. `backward` divides the loss by
    `accum_steps` exactly once. On the boundary the gradients are clipped, the
    optimizer and scheduler step (the scheduler counts optimizer steps, P-LOOP-4),
    and gradients are zeroed. `last=True` closes a window that did not fill: its
    gradients are rescaled so the step is the mean over the micro-batches it saw.
    Construction is a collective: it checks that every rank has the same
    `accum_steps` and raises `DistributedMismatchError` on all ranks otherwise.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        accum_steps: int,
        *,
        scheduler=None,
        grad_clip: float = 0.0,
        scaler=None,
    ):
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be at least 1, got {accum_steps}")
        # Fail before the first step, not after silent non-training (P-DDP-3, P-FSDP-7).
        check_optimizer(model, optimizer)
        assert_same_across_ranks("accum_steps", accum_steps)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.accum_steps, self.grad_clip, self.scaler = accum_steps, grad_clip, scaler
        self.optimizer_steps = 0
        self.last_grad_norm: float | None = None
        self._in_window = 0
        self.boundary, self._counted = False, False
        """`boundary`: the micro-step in progress closes the window (its end steps)."""
        self.stepped = False
        """True right after the micro-step that ran the optimizer step."""

    @property
    def window_start(self) -> bool:
        """True before the first micro-step of an optimizer step's window."""
        return self._in_window == 0

    @property
    def step_in_flight(self) -> int:
        """The optimizer step the current micro-batch belongs to (1-based): the one just
        taken, from a window's closing backward until the next micro-batch starts."""
        return self.optimizer_steps + (0 if self.stepped else 1)

    @property
    def next_is_boundary(self) -> bool:
        """True when the next `micro_step` closes the window (the optimizer steps)."""
        return self._in_window + 1 >= self.accum_steps

    @contextlib.contextmanager
    def micro_step(self, last: bool = False) -> Iterator[None]:
        """One micro-batch: run its forward and `backward` inside the block.

        Inside a window the block runs under `no_sync` (no gradient communication);
        on the window's last micro-batch, or when `last=True` closes a window early,
        the gradients are synchronised and, as the block leaves (or earlier, at
        `end_micro_step`), clipped and stepped (optimizer, scheduler, scaler), then
        zeroed; `stepped` is True afterwards. An exception inside the block propagates
        and nothing more is stepped.
        """
        self.boundary, self._counted, self.stepped = last or self.next_is_boundary, False, False
        with contextlib.nullcontext() if self.boundary else no_sync(self.model):
            yield
        self.end_micro_step()

    def end_micro_step(self) -> None:
        """Count this micro-step and, on the window's boundary, clip and step the optimizer
        and scheduler; once per micro-step. `micro_step` calls it on leaving its block;
        `dt.Job.backward` calls it right after the boundary's backward, so that a loop
        left after that backward (a `break`, a `return`, an exception) keeps its step."""
        if self._counted:
            return
        self._counted = True
        self._in_window += 1
        if self.boundary:
            self._optimizer_step()
            self.stepped = True

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss / accum_steps` (and of the grad scaler's scaled loss)."""
        loss = loss / self.accum_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def _optimizer_step(self) -> None:
        if self._in_window < self.accum_steps:  # a short final window
            factor = self.accum_steps / self._in_window
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            self.last_grad_norm = clip_grad_norm(self.model, self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self._in_window = 0


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int = -1, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay, counted in optimizer steps (P-LOOP-4).

    Returns a `LambdaLR` over `optimizer`: the learning rate rises linearly to each
    group's own lr over `warmup_steps`, then falls along a half cosine to
    `min_lr_ratio` x lr at `total_steps` and stays there. `warmup_steps=-1` picks
    min(5% of total_steps, 2000). Step it once per optimizer step, not per
    micro-batch (`dt.Accumulator` and `dt.Job` do). Its position is in its
    `state_dict`, so a checkpoint that holds the scheduler resumes the schedule.
    """
    if warmup_steps < 0:
        warmup_steps = min(max(1, round(0.05 * total_steps)), 2000)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
