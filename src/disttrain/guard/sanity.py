"""Checks for a job that looks distributed but is not.

Peers fall into these silently: a launcher that starts one process and exits 0, or
two unsynchronised copies training on the same data while reporting world size 2.
Each check warns with `NotDistributedWarning` when the situation may be deliberate,
and raises `NotDistributedError` (a `UserError`) when it is certainly wrong or when
`strict=True`. Each message names the case, its cause and the fix.

- `check_world_size(expected)`: the launcher started fewer processes than asked.
- `check_threads()`: threads per rank x ranks on this host exceed the CPU cores.
- `check_wrapped(model, optimizer)`: world > 1 but the stepped model is not wrapped.
- `check_first_batch(batch)`: every rank draws the same first batch (a collective).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from disttrain.errors import UserError

EXPECTED_WORLD_ENV = "DISTTRAIN_EXPECTED_WORLD_SIZE"
"""Set by `disttrain run` to nnodes x nproc when both are fixed numbers."""


class NotDistributedError(UserError):
    """The job is certainly not running as the distributed job it claims to be.

    Raised by the start checks (`dt.start_guard`, `dt.Job`) when fewer processes run
    than were asked for (`disttrain run` sets the expected world size), and by the
    sanity checks when a rank trains an unwrapped model or every rank drew the same
    first batch in a case that cannot be deliberate. A `UserError` whose message
    names the case, its cause and the fix.
    """


class NotDistributedWarning(UserWarning):
    """The job may not be running as the distributed job it claims to be.

    Warned (not raised) when the situation may be deliberate: more processes than
    expected (an elastic job may have grown), oversubscribed CPU threads, an unwrapped
    model or ranks drawing the same batch. The checks take `strict=True` to raise
    `NotDistributedError` instead; Python's warning filters can do the same.
    """


def _report(message: str, *, certain: bool, strict: bool) -> None:
    if certain or strict:
        raise NotDistributedError(message)
    warnings.warn(message, NotDistributedWarning, stacklevel=3)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def check_world_size(expected: int | None = None, *, strict: bool = False) -> None:
    """Raise `NotDistributedError` when fewer processes run than were asked for.

    `expected` defaults to `DISTTRAIN_EXPECTED_WORLD_SIZE` (set by `disttrain run`);
    without either, nothing is checked. A missing torchrun environment counts as a
    world of 1, the `accelerate launch --cpu --num_processes 2` trap. More processes
    than expected only warn (an elastic job may have grown).
    """
    if expected is None:
        env = os.environ.get(EXPECTED_WORLD_ENV, "")
        expected = int(env) if env.isdigit() else None
    if expected is None:
        return
    world = _world()
    if world < expected:
        how = (
            "no torchrun environment (WORLD_SIZE unset): this is a single process"
            if "WORLD_SIZE" not in os.environ
            else f"WORLD_SIZE is {world}"
        )
        raise NotDistributedError(
            f"looks distributed but is not: {expected} processes were asked for, but {how}. "
            f"Launch with `disttrain run --nproc {expected} SCRIPT` (or torchrun), and check "
            f"that every node joined the rendezvous."
        )
    if world > expected:
        _report(
            f"{world} processes run but {expected} were asked for; check --nnodes/--nproc.",
            certain=False,
            strict=strict,
        )


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(*, local_world: int | None = None, strict: bool = False) -> None:
    """Warn when torch's intra-op threads x the ranks on this host exceed the cores.

    Oversubscription makes every rank slower than one rank alone (2.35x per step
    measured on a 2-core machine); the fix is OMP_NUM_THREADS = cores // ranks, which
    `disttrain run` sets unless the user did.
    """
    ranks = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    threads, cores = torch.get_num_threads(), usable_cores()
    if ranks > 1 and threads == 1 and ranks > cores:  # OMP_NUM_THREADS=1 already: too many ranks
        _report(
            f"CPU oversubscribed: {ranks} ranks on this host for {cores} cores, each already on "
            f"1 thread, so steps run much slower. Start at most {cores} processes per host "
            f"(--nproc {cores}).",
            certain=False,
            strict=strict,
        )
    elif ranks > 1 and threads * ranks > cores:
        _report(
            f"CPU oversubscribed: {ranks} ranks on this host x {threads} threads each = "
            f"{threads * ranks} threads for {cores} cores, so steps run much slower "
            f"(2.35x measured). Set OMP_NUM_THREADS={max(1, cores // ranks)} or call "
            f"torch.set_num_threads({max(1, cores // ranks)}); `disttrain run` does this.",
            certain=False,
            strict=strict,
        )


def is_wrapped(model: nn.Module) -> bool:
    """True when a data-parallel strategy manages `model` (DDP, DP, FSDP1, FSDP2)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return True
    except ImportError:  # pragma: no cover - old torch
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


def check_wrapped(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = False) -> None:
    """In a world > 1, check that the model the optimizer steps is wrapped by a strategy.

    An unwrapped model trains one unsynchronised copy per rank. That warns (a user may
    all-reduce gradients by hand); an optimizer that steps none of `model`'s
    parameters raises `NotDistributedError`: it was built over another copy.
    """
    if _world() <= 1:
        return
    if optimizer is not None:
        mine = {id(p) for p in model.parameters()}
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        if stepped and not any(id(p) in mine for p in stepped):
            raise NotDistributedError(
                "looks distributed but is not: the optimizer steps none of the wrapped model's "
                "parameters, so the synchronised model never changes. Build the optimizer "
                "after `dt.wrap(model)`, over the wrapped model's parameters (P-DDP-3)."
            )
    if not is_wrapped(model):
        _report(
            f"looks distributed but is not: world size is {_world()} but the model is not "
            f"wrapped by any strategy (DDP/FSDP), so each rank trains its own copy and "
            f"gradients are never averaged. Use `model = dt.wrap(model)` before building "
            f"the optimizer.",
            certain=False,
            strict=strict,
        )


def batch_digest(batch: Any) -> int:
    """A 63-bit hash of every tensor (and plain value) in a nested batch."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            for item in x:
                feed(item)
        else:
            h.update(repr(x).encode())

    feed(batch)
    return int.from_bytes(h.digest()[:8], "big") >> 1


def check_first_batch(batch: Any, *, strict: bool = False, tp: int = 1) -> None:
    """Warn when every data-parallel rank drew the same first batch: the data is not
    sharded (P-DATA-1).

    A collective (one all-gather of an integer): call it on every rank with the first
    batch. Under tensor parallelism (`tp` > 1) the `tp` consecutive ranks of a group
    must draw the same batch: one that differs raises `NotDistributedError`; the groups
    are compared as one rank each. Replicated data can be deliberate, hence a warning.
    """
    if _world() <= 1 or not dist.is_initialized():
        return
    from disttrain.runtime.collectives import gather_ints

    digests = gather_ints(batch_digest(batch))
    apart = [r for r, d in enumerate(digests) if d != digests[r - r % tp]]
    if apart:
        _report(
            f"ranks {apart} drew another first batch than the first rank of their tensor-parallel "
            f"group (parallel.tp = {tp}); the ranks of one group must read the same batch, as "
            f"dt.Job's loader gives them.",
            certain=True,
            strict=strict,
        )
    digests = digests[::tp]
    if len(digests) <= 1:
        return
    if len(set(digests)) == 1:
        _report(
            f"looks distributed but is not: all {len(digests)} ranks drew the same first "
            f"batch, so they train on the same data and the job is no faster than one "
            f"process. Use `dt.DistributedSampler(dataset)` (a disjoint shard per rank, "
            f"P-DATA-1) instead of a plain shuffle or a shared seed.",
            certain=False,
            strict=strict,
        )
    else:
        same = [r * tp for r, d in enumerate(digests) if digests.count(d) > 1]  # global ranks
        if same:
            _report(
                f"ranks {same} drew identical first batches; their data shards overlap (P-DATA-1).",
                certain=False,
                strict=strict,
            )
