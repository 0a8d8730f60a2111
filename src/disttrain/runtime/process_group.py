"""Process-group lifetime, device binding, seeding and rank information.

`init()` reads the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), chooses the backend from the device (P-INIT-1), binds the device before
any CUDA allocation (P-INIT-2) and starts the process group with an explicit
timeout. Without a torchrun environment it is a world of 1 and starts no group, so
the same script runs unchanged on one device. `distributed()` is the context-manager
form that destroys the group on every exit path, exceptions included (P-INIT-6).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from disttrain.errors import UserError
from disttrain.runtime import processes, torch_compat

# Seed offsets: the model stream is shared; the data/dropout stream is per rank.
_RANK_STREAM = 1_000_003


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job. Immutable; one per process.

    Returned by `dt.init` and `dt.distributed` and, afterwards, by `dt.rank_info()`.
    `rank` and `world_size` are global; `local_rank` and `local_world_size` count the
    processes of this node. `device` is the device this rank trains on, `seed` the
    base seed given to `init`. `is_main` is True on global rank 0 (the rank that logs
    and writes files); `distributed` is False when no process group was started.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """The group's backend string; None when no group was started (no launcher)."""
    seed: int

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the only rank that logs and writes files (P-LOOP-1)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group runs (even in a world of 1 under a launcher)."""
        return self.backend is not None


def rank_info() -> RankInfo:
    """The `RankInfo` of the running `init()` (or `dt.Job`); a world of 1 on CPU when
    none ran.

    Starts nothing and never raises; before `init` and after `shutdown` it describes
    rank 0 of a world of 1 with no backend.
    """
    if processes.STATE.rank_info is not None:
        return processes.STATE.rank_info
    return RankInfo(
        rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None, seed=0
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(
            f"environment variable {name}={value!r} is not an integer; "
            f"launch with torchrun or `disttrain run`, which set it."
        ) from None


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device 'cuda' was asked for but no CUDA device is visible; use device='cpu' or 'auto'.")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UserError(
                f"LOCAL_RANK {local_rank} has no GPU: only {count} visible. "
                f"Start at most {count} processes per node (P-INIT-5)."
            )
        torch.cuda.set_device(local_rank)  # before any allocation (P-INIT-2)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with one value."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a dependency, but seeding must not depend on it
        pass


def seed_rank_stream(info: RankInfo | None = None) -> None:
    """Switch the global RNGs to this rank's own stream, derived from (seed, rank).

    Call after the model is built (all ranks share the init seed) so dropout masks and
    data augmentation differ across ranks. `wrap()` calls it for you.
    """
    info = info or rank_info()
    seed_all(info.seed + _RANK_STREAM * (info.rank + 1))


def seed_step(step: int, info: RankInfo | None = None) -> None:
    """Seed the global RNGs from (seed, step, rank) at the start of optimizer step `step`.

    Dropout masks then depend only on where the run is, not on how it got there, so a
    resume is bit-exact at the same world size and well defined after a world-size
    change (rank r of the new world draws the stream of (seed, step, r)).
    """
    info = info or rank_info()
    seed_all((info.seed * 1_000_003 + step) * 65_537 + info.rank)


_ACCELERATOR_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}


def group_backend(device_type: str, backend: str = "auto") -> str:
    """The backend string for a group on `device_type`: "gloo" on CPU; on an
    accelerator "cpu:gloo,cuda:nccl" (torch's per-device form), because NCCL moves
    device tensors only and the small collectives on host values need gloo.
    `backend` "gloo" keeps gloo for everything; "nccl"/"auto" pick the accelerator's."""
    if device_type == "cpu" or backend == "gloo":
        return "gloo"
    accel = _ACCELERATOR_BACKENDS.get(device_type, backend) if backend == "auto" else backend
    return f"cpu:gloo,{device_type}:{accel}"


def init(
    *,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 300.0,
    seed: int = 0,
    store: dist.Store | None = None,
) -> RankInfo:
    """Start the process group from the torchrun environment and return `RankInfo`.

    Seeds every RNG with `seed` on every rank, so the model initialisation is the same
    everywhere. Under a launcher (WORLD_SIZE in the environment) a group is started
    even in a world of 1, so user code that calls `torch.distributed` keeps working
    when an elastic job shrinks to one rank; a plain `python script.py` starts none.
    On an accelerator the group gets a backend per device (`group_backend`): CPU
    tensors (metrics, votes, ids) go through gloo, device tensors through NCCL.
    Raises `UserError` for an inconsistent environment; a rendezvous that cannot
    complete fails after `timeout_s` instead of torch's 10-30 minutes. Creating a
    process group is not thread-safe: call from the main thread (P-INIT-3).
    `store`: rendezvous on this store instead of MASTER_ADDR:MASTER_PORT (the
    generations of `elastic.fast_recovery`, each on its own prefix).
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if not 0 <= rank < world:
        raise UserError(
            f"RANK={rank} is outside WORLD_SIZE={world}; the launcher environment "
            f"is inconsistent. Launch with `disttrain run`."
        )
    dev = _pick_device(device, local_rank)
    chosen = None
    if store is None:  # a recovery's generations skip the collection (0.3-0.6 s on a loaded host)
        _release_lingering()  # a new group may need the port a lingering one's store holds
    if "WORLD_SIZE" in os.environ:
        chosen = group_backend(dev.type, backend)
        if not dist.is_initialized():
            on_store: dict[str, Any] = {"store": store, "rank": rank, "world_size": world} if store else {}
            dist.init_process_group(
                backend=chosen,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=dev if dev.type == "cuda" else None,
                **on_store,
            )
    if "RANK" in os.environ:  # a launcher's worker: `ps` names its rank (a promoted spare's too)
        processes.name_worker(rank=rank, local_rank=local_rank)
    seed_all(seed)
    processes.freeze_long_lived()
    note_place(rank, world)
    info = RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        device=dev,
        backend=chosen,
        seed=seed,
    )
    processes.STATE.rank_info = info
    return info


def note_place(rank: int, world: int) -> None:
    """Record this process's place in the group just started (`init`; a spare's rehearsal
    on a fake group); at another place than its last group's (a fast recovery's
    generation after a shrink, a join), forget the sharding plans torch cached at the
    old one (`torch_compat.forget_sharding_plans`)."""
    state = processes.STATE
    if state.last_place is not None and state.last_place != (rank, world):
        torch_compat.forget_sharding_plans()
    state.last_place = (rank, world)


def shutdown(*, collect: bool = True) -> None:
    """Destroy the process group if one is running. Safe to call twice.

    `collect=False` (an in-memory recovery, where a garbage collection costs tenths of
    a second) holds every destroyed group, as below, without looking for other holders.

    A group that something still references after the destroy (a DDP module's reducer,
    a DeviceMesh, a user's global) must not be destructed during interpreter
    finalization: torch 2.13's gloo group destructor aborts the process there about
    one time in two ("terminate called without an active exception", exit -6), which
    torchrun reports as a failed worker. Such groups are held here; the next `init`
    frees those nobody else holds any more (while the interpreter is alive, which is
    harmless), and at exit the still-referenced ones are never destructed (the OS
    reclaims them).
    """
    state = processes.STATE
    if collect:
        processes.thaw_long_lived()  # what init and the first Checkpointer froze is collectable again
    if dist.is_available() and dist.is_initialized():
        groups = torch_compat.process_groups()
        dist.destroy_process_group()
        if collect:
            gc.collect()
            state.lingering_groups.extend(g for g in groups if sys.getrefcount(g) > 3)  # groups, g, argument
        else:
            state.lingering_groups.extend(groups)
        del groups
        if not state.exit_hook_set:
            atexit.register(_release_lingering, True)
            state.exit_hook_set = True
    state.rank_info = None


def hold_destroyed(groups: list) -> None:
    """Hold `groups`, which a script's own `destroy_process_group()` is about to destroy,
    as `shutdown` holds its own: whatever still references one (a DDP reducer, a
    DeviceMesh) can then be freed at any moment without destructing the group, and at
    exit the still-referenced ones are never destructed. Installed for every script
    `disttrain run` starts (`hold_script_groups`)."""
    state = processes.STATE
    held = {id(g) for g in state.lingering_groups}
    state.lingering_groups.extend(g for g in groups if id(g) not in held)
    if not state.exit_hook_set:
        atexit.register(_release_lingering, True)
        state.exit_hook_set = True


def hold_script_groups() -> None:
    """Route every `torch.distributed.destroy_process_group()` of this process through
    `hold_destroyed` (see `torch_compat.on_destroy_process_group` for the hang it
    prevents: a correct DDP script that never exits)."""
    torch_compat.on_destroy_process_group(hold_destroyed)


def _release_lingering(at_exit: bool = False) -> None:
    """Drop our hold on lingering groups nobody else references (they are destructed
    now); at exit, make the still-referenced ones immortal instead. Nothing held:
    nothing to do (a collection costs tenths of a second in a process with torch)."""
    lingering = processes.STATE.lingering_groups  # referenced elsewhere when shutdown() destroyed them
    if not lingering:
        return
    held = list(lingering)
    lingering.clear()
    for group in held:
        if sys.getrefcount(group) <= 3:  # held, group, the argument: ours alone
            continue
        if at_exit:
            torch_compat.make_immortal(group)
        else:
            lingering.append(group)
    del held
    gc.collect()


@contextlib.contextmanager
def distributed(**kwargs) -> Iterator[RankInfo]:
    """`with dt.distributed(seed=...) as info:`: `dt.init(**kwargs)`, then
    `dt.shutdown()` on every exit path, exceptions included (P-INIT-6).

    Yields the `RankInfo`. `kwargs` are `init`'s (`backend`, `device`, `timeout_s`,
    `seed`); its errors (`UserError` for an inconsistent torchrun environment, a
    timeout for a rendezvous that cannot complete) are raised on entry, before the
    block runs. An exception inside the block propagates after the group is gone.
    """
    info = init(**kwargs)
    try:
        yield info
    finally:
        shutdown()


def barrier() -> None:
    """Wait until every rank of the default group reaches this call.

    A collective: a rank that never arrives makes the others fail after the group's
    timeout (`init`'s `timeout_s`). A no-op when no process group runs (a world of 1
    under plain `python`).
    """
    if dist.is_initialized():
        dist.barrier()
