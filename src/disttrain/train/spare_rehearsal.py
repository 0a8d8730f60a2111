"""A warm spare rehearses its first sharded step while it stands by (`disttrain train`
under `[elastic] fast_recovery`, docs/elastic.md).

Under FSDP2 and tensor parallelism the parameters and gradients are DTensors. The
first time a process runs an operator on DTensors of given shapes, placements and
mesh, torch works out the result's sharding (`torch.distributed.tensor`'s sharding
propagation, run on fake tensors) and caches it for the rest of the process. The
gradient clip and the optimizer step of a small GPT make about fifty such operators:
0.5 s of a promoted spare's first step on a 2-core host, while the survivors, whose
caches are warm, wait for it in the step's collectives (and a node's admission pays
the same in its newcomers).

So a spare that has stood by a while (`promotion_wait.CALM_S`) builds the config's
model, wraps it as the job does at the place it will most likely take
(`fast_recovery.place_to_join`) on a process group of torch's "fake" backend (one that
moves no data), and runs the clip and one optimizer step on zero gradients. The cache
is keyed by the operator, the shapes and placements and the mesh's ranks and layout,
not by the group, so the real first step finds it. It also hands back the mesh it
cached, with the rehearsed rank's coordinate: a spare promoted to another place
forgets the rehearsal when its group starts (`runtime.process_group.note_place`), and
pays the first step as before. Nothing else survives the rehearsal: the fake group is
destroyed, this process's rank info is reset and its objects are collected. A
promotion that arrives during the rehearsal cuts it short
(`fast_recovery.wait_for_promotion`).

Only where it is safe and pays (`pays`): FSDP on the CPU, without tensor parallelism,
compile or fp8. On a GPU the spare shares its device with the training process, which
the model and optimizer state of a rehearsal must not take memory from.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from disttrain.config import Config
from disttrain.elastic.promotion_wait import promotion_deferred
from disttrain.parallel import wrap
from disttrain.parallel.optimizers import build_optimizer
from disttrain.runtime import process_group, processes
from disttrain.runtime.log import LOGGER
from disttrain.runtime.process_group import RankInfo
from disttrain.train.accumulation import clip_grad_norm


def pays(cfg: Config) -> bool:
    """Whether a spare of this config rehearses: `elastic.rehearse_spares`, FSDP's DTensor
    parameters on the CPU, not compiled, not fp8. Not with tensor parallelism: its
    meshes' subgroups are not proven to line up between a rehearsal and the real group."""
    p, t = cfg.parallel, cfg.train
    if not cfg.elastic.rehearse_spares:
        return False
    sharded = p.strategy == "fsdp" and p.tp == 1
    on_cpu = p.device == "cpu" or (p.device == "auto" and not torch.cuda.is_available())
    return sharded and on_cpu and not t.compile and t.precision != "fp8"


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of a process group of `world` ranks on torch's "fake" backend
    (which moves no data), with its rank info; destroyed on leaving, however it is left
    (a promotion may interrupt it anywhere but in the group's start and end, which it
    waits for: `promotion_wait.promotion_deferred`). The place is noted as a
    group's (`process_group.note_place`): a real group at another place forgets what was
    cached here. The caller must have no group of its own."""
    try:
        with promotion_deferred():  # a group half started is not left behind
            process_group.note_place(rank, world)
            dist.init_process_group("fake", rank=rank, world_size=world)
            processes.STATE.rank_info = RankInfo(
                rank=rank,
                local_rank=0,
                world_size=world,
                local_world_size=1,
                device=torch.device("cpu"),
                backend="fake",
                seed=0,
            )
        yield
    finally:
        with promotion_deferred():  # nor one half destroyed
            processes.STATE.rank_info = None
            if dist.is_initialized():  # the real group must not find this one
                dist.destroy_process_group()


def rehearse(cfg: Config, build_model: Callable[[], torch.nn.Module], rank: int, world: int) -> float | None:
    """Rehearse the config's first clip and optimizer step as `rank` of `world` (see the
    module); the seconds it took, or None when it does not pay (`pays`) or fails. A
    failure is logged and otherwise ignored: the real step then works it out itself."""
    if world < 2 or not 0 <= rank < world or dist.is_initialized() or not pays(cfg):
        return None
    start = time.perf_counter()
    try:
        with fake_world(rank, world):
            _one_step(cfg, build_model())
    except Exception as e:  # noqa: BLE001  (a rehearsal only warms a cache: never the spare's end)
        LOGGER.debug(f"disttrain: the spare's rehearsal of a sharded step failed ({type(e).__name__}: {e})")
        gc.collect()
        return None
    # Its model and optimizer hold reference cycles. Not collected when a promotion cut
    # the rehearsal short (a BaseException): the take-over must not wait for it.
    gc.collect()
    return time.perf_counter() - start


def _one_step(cfg: Config, raw: torch.nn.Module) -> None:
    """Wrap `raw` as `dt.Job.wrap` does for this config, then clip zero gradients and step
    the config's optimizer once."""
    model = wrap(
        raw,
        cfg.parallel,
        precision=cfg.train.precision,
        compile=False,
        fp8_recipe=cfg.train.fp8_recipe,
        tp_plan=cfg.parallel.tp_plan or None,
    )
    optimizer = build_optimizer(model, cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if cfg.optim.grad_clip > 0:
        clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
