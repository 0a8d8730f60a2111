"""In-process recovery: a dead rank is replaced by a warm spare and the survivors keep
the model in their memory (`[elastic] fast_recovery = true`, docs/elastic.md).

The training processes of one torchrun worker slot are children of
`disttrain.launch.slot_supervisor`, which hosts (on global rank 0's slot) a
`TCPStore` at MASTER_ADDR:MASTER_PORT that outlives every training process. The
role a child plays comes from `ROLE_ENV`:
- "first": the slot's first training process; it joins generation 0 (or a later one).
- "spare": imported torch and disttrain and built its datasets, then blocks until
  its supervisor writes a line on its stdin (the slot's training process died). It
  then bumps the generation counter and joins that generation as the newcomer.

What the ranks write to the store for each other is sealed with the job's secret and
checked on reading (`elastic.job_store`); the state itself goes over the group as
tensors and JSON, never as a pickle.

A generation is one process group: every member adds itself to the generation's
join counter and the group is created with `init_process_group(store=PrefixStore(
"disttrain/fast/g<N>/pg", store))`, where `store` is the job's, or under the etcd a
TCP store the generation's rank 0 hosts (`elastic.generation_store`). When a
collective fails (gloo raises on a closed peer) a survivor keeps a snapshot of its
committed state (`TrainState.state_dict`, which under DDP needs no collective),
destroys the group and joins the next generation. There the member(s) with the
highest committed step broadcast their state to the others, so the failed step is
redone with the same samples and the same dropout stream (`runtime.seed_step`), and
nothing is read from disk. When no member holds a state (every holder died), the disk
checkpoint is the source, as on a restart.

Which failure starts a new generation is `runtime.failures`' verdict: the machine's
does; the program's does not (the rank that raised it reports it through the launcher
and waits to be stopped, the others exit 0 quietly); one that cannot be classified
does, until it ends two generations in a row. A survivor cuts its groups' connections
and no other (`elastic.group_sockets`). A process that waits for a generation longer
than `wait_s` raises the collective error it saw (no rank died: a real error); a
supervisor's loss falls back to torchrun's restart and the disk checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from disttrain import runtime, worker_notes
from disttrain.elastic import (
    buddy_reshard,
    etcd_store,
    generation_store,
    group_sockets,
    job_stop,
    job_store,
    join_node,
    liveness,
    membership,
    promotion_wait,
)
from disttrain.elastic.buddy_copy import BuddyCopy, pack, resharded_words, unpack
from disttrain.elastic.job_store import JobStore
from disttrain.errors import DistributedMismatchError, UserError
from disttrain.runtime import failures, fault_injection, processes, torch_compat
from disttrain.runtime.collectives import all_gather_json, broadcast_bytes, gather_ints
from disttrain.runtime.log import EVERY_RANK, LOGGER, speaker

ROLE_ENV = "DISTTRAIN_FAST_ROLE"
"""Set by the slot supervisor on its children: "first" or "spare"."""
GEN_KEY = "disttrain/fast/gen"
EXPECTED_WORLD_ENV = "DISTTRAIN_EXPECTED_WORLD_SIZE"  # guard.sanity's: the world the launcher started
TOTAL_SLOTS_ENV = "DISTTRAIN_TOTAL_SLOTS"
"""torchrun's WORLD_SIZE, the hot spares' slots included (`run` keeps it here before it
sets WORLD_SIZE to the training world, `membership.training_world`)."""


def enabled() -> bool:
    """True in a training process started by a slot supervisor."""
    return os.environ.get(ROLE_ENV) in ("first", "spare")


def is_spare() -> bool:
    return os.environ.get(ROLE_ENV) == "spare"


def place_to_join(handoff: Handoff) -> tuple[int, int]:
    """(rank, world) a spare of this slot most likely trains at once promoted: a training
    slot's own rank in the training world; for a hot-spare slot the rank of the same
    local slot on the first training node; for a slot of a node that joins
    (`elastic.join_node`) the places after the training world's. A guess (a shrink, a
    join, another node's loss change it) that only a spare's rehearsal uses: a process
    at another place forgets what it rehearsed (`runtime.process_group.note_place`)."""
    world, slot = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if handoff.joinable and slot >= handoff.total:
        local, nproc = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return world + local, world + nproc
    return slot % world, world


def wait_for_promotion(standby: Callable[[], None] | None = None) -> None:
    """Block until the supervisor says this spare takes over (`promotion_wait.wait`, with
    `standby` run once it has waited `promotion_wait.CALM_S` unpromoted); it then joins
    as the next generation's newcomer."""
    promotion_wait.wait(standby)
    os.environ[ROLE_ENV] = "newcomer"


def warm_up() -> None:
    """Import now what the first DDP construction, the state hand-off and rank 0's metrics
    import lazily (torch._dynamo: about 3 s; DCP's state-dict helpers; TensorBoard's
    writer, 0.1 s idle and 0.35 s measured in a take-over on two loaded cores; rich's
    progress bar, 0.06 s idle and 0.09 s in a take-over), so a promoted spare, or a
    survivor that becomes rank 0, does not pay for it during a recovery while every peer
    waits."""
    torch_compat.import_dynamo()  # DistributedDataParallel.__init__ reads its config
    import rich.console  # noqa: F401  (train/progress.py: rank 0's bar)
    import rich.progress  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (TrainState.load_state_dict)

    try:  # [log] tensorboard is on by default; train/run_log.py says what to do without it
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass

    if etcd_store.configured():  # the store's client: connect_store imports it otherwise
        etcd_store.preload()


def connect_store(timeout_s: float) -> JobStore:
    """A client of the supervisor's store (it may still be starting: the client
    retries), sealing and checking values with the job's secret (`elastic.job_store`)."""
    return job_store.connect(timeout_s)


def join(store: JobStore, gen: int, slot: int, world: int, wait_s: float) -> tuple[int, list[int]]:
    """Join generation `gen` or a later one as `slot` (the rank this slot had in the
    first generation of a job of `world` ranks); return it and its members (the slots in
    it, in rank order) once all have joined.

    A generation someone bumps past (another death during the wait) is left for the
    newer one. One that stays short past `membership.STALL_S` watches its missing
    members' supervisors: those that stopped beating are gone with their node, and the
    generation goes on without them (`membership.settle`). Raises `TimeoutError` after
    `wait_s` without a full generation, `membership.LeftOut` when this slot was taken for gone."""
    deadline = time.monotonic() + wait_s
    while True:
        members = membership.roster(store, world)
        key = f"disttrain/fast/g{gen}/joined"
        membership.arrive(store, gen, slot)
        arrived = store.add(key, 1)
        since, watch = time.monotonic(), None
        while True:
            if slot not in members:
                raise membership.LeftOut(membership.left_out_words(slot, gen))
            if arrived > len(members):  # full without this process: in use (`_past`)
                gen = _past(store, gen)
                break
            if store.add(key, 0) >= len(members):
                return gen, members
            current = store.add(GEN_KEY, 0)
            if current > gen:
                gen = current
                break
            if gen > 0 and time.monotonic() - since > membership.STALL_S:
                members = membership.decided(store, gen) or members
                watch = watch or membership.Watch(store, gen, members, _standby(store, world))
                lost = watch.lost()
                if lost and job_stop.adopt(store):  # stopped by a rank of theirs, not lost: no shrink
                    raise SystemExit(0) from None  # this node's launcher says why, as theirs does
                if lost:
                    members = membership.settle(store, gen, members, lost, GEN_KEY, watch.fresh, watch.cause())
                if lost is not None:  # watch again: for the spares that take the places, or anew
                    watch = None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"generation {gen}: only {store.add(key, 0)} of {len(members)} ranks joined within {wait_s:.0f} s"
                )
            time.sleep(0.002)


def _standby(store: JobStore, world: int) -> list[int]:
    """The hot-spare and joined slots that could take a lost slot's place
    (`membership.standby_slots`); no store read in a job that has neither."""
    total = int(os.environ.get(TOTAL_SLOTS_ENV, world))
    return membership.standby_slots(store, world, total) if total > world or join_node.joinable() else []


def _past(store: JobStore, gen: int) -> int:
    """The generation to join after `gen`, found full before this process arrived, and the
    counter moved past it. The survivors of a failure with nobody dead move on to the
    next generation without a newcomer's bump of the counter, so a spare promoted later
    bumps it onto the generation they are in; it then starts the one after, where they
    meet it once their collective fails (and see, by the counter, that a peer died)."""
    return store.add(GEN_KEY, max(1, gen + 1 - store.add(GEN_KEY, 0)))


@dataclass
class Handoff:
    """What one attempt (one generation) of the training function gets and leaves.

    `memory`: this process's committed state from the failed attempt (None on a
    newcomer or a first start); `cache`: objects kept across attempts (datasets);
    `live`: what the running attempt registered with `keep` (its `TrainState`, the
    accumulator and the guard), read after a failure. `buddy`: under a sharded
    strategy, the packs of `elastic.buddy_copy` (they replace `memory`: no rank holds
    the whole state)."""

    gen: int
    memory: dict | None = None
    cache: dict = field(default_factory=dict)
    live: dict = field(default_factory=dict)
    buddy: BuddyCopy | None = None
    store: JobStore | None = None
    listening: set = field(default_factory=set)
    """The listeners this process had when the generation began (`group_sockets`)."""
    _buddy_gen: int = -1
    from_world: int = 0
    """The world this process's buddy copies were dropped from in this generation,
    because the job shrank (0: none were): `restore` reshards them or says why it reads
    the disk."""
    held: dict = field(default_factory=dict)
    """After a shrink: old rank -> {step: pack} of the buddy copies this process held in
    the larger world (`elastic.buddy_reshard`); emptied once `restore` used them."""
    members: list = field(default_factory=list)
    """The slots of this generation, in rank order."""
    total: int = 0
    """torchrun's slot count: joined nodes' slots are numbered from it (`elastic.join_node`)."""
    joinable: bool = False
    """Whether nodes may join (the store is the etcd): rank 0 then asks `joiners_waiting`."""
    _polled: float = 0.0
    _waiting: list = field(default_factory=list)
    """Rank 0: the joined slots found ready at the last poll."""
    veteran: bool = False
    """This process passed a generation's start checks (`dt.Job`): its values are the job's."""
    unadmitted: bool = False
    """This process differed from the running job at start and was not admitted."""

    def refuse_newcomers(self, error: DistributedMismatchError) -> None:
        """After this generation's start checks failed on every rank (`error`, which holds
        each rank's fingerprint): when the ranks new to the job (a node that joined, a hot
        spare) are the ones that differ from the veterans (`join_node.differing_newcomers`),
        they are not admitted and the job goes on without them. Such a newcomer raises
        `join_node.NotAdmitted` (its node's error, kept off the job's store: it must not
        stop the job); every other rank `join_node.Refused`. Returns when that is not the
        case (the caller raises `error`). A collective."""
        odd, keys = join_node.differing_newcomers([bool(v) for v in gather_ints(int(self.veteran))], error.fingerprints)
        if not odd:
            return
        if dist.get_rank() not in odd:
            raise join_node.Refused([self.members[r] for r in odd], keys)
        self.unadmitted = True
        job_stop.share(None)
        raise join_node.NotAdmitted(
            f"this node's rank was not admitted to the running job, which goes on without it: {error} "
            f"Start the joining node with the job's own command and config."
        ) from None

    def peer_gone(self) -> bool:
        """Whether a peer of this generation has died: a promoted spare bumped the
        generation counter."""
        return self.store is not None and self.store.add(GEN_KEY, 0) > self.gen

    def publish_listeners(self) -> None:
        """Put this rank's group listeners on the store (`group_sockets.publish`): called
        right after each group of the generation is made (the default one, the buddy
        copy's, the checkpointer's), so a rank blocked in a collective has published
        every group it is in."""
        if self.store is not None and dist.is_initialized():
            group_sockets.publish(self.store, f"disttrain/fast/g{self.gen}", dist.get_rank(), self.listening)

    def committed(self, step: int, state, first: bool = False) -> None:
        """After each committed step, and once when an attempt starts (`first`: copied
        whatever `elastic.buddy_every` says, so a newcomer's shard has a buddy at once):
        under a sharded strategy, the buddy copy of `state` at `step`. A collective.
        Step 0 is not copied: a fresh start rebuilds it."""
        if self.buddy is not None and step > 0:
            state.step, state.epoch = step, getattr(state.sampler, "epoch", state.epoch)
            self.buddy.start(step, state, force=first)

    def joiners_waiting(self, fits: Callable[[int], bool]) -> bool:
        """On rank 0 of a job nodes may join: whether joined slots are ready and as many as
        make a world that `fits` (the batch policy: `join_node.fitting`) can be admitted;
        the store is read at most every `join_node.POLL_S`. False on the other ranks and
        in other jobs. No collective: the step's preemption vote carries the answer."""
        if not self.joinable or self.store is None or dist.get_rank() != 0:
            return False
        if time.monotonic() - self._polled >= join_node.POLL_S:
            self._polled = time.monotonic()
            self._waiting = join_node.fitting(join_node.ready(self.store, self.total, self.members), self.members, fits)
        return bool(self._waiting)

    def admit_joiners(self, step: int, state, fits: Callable[[int], bool]) -> None:
        """At a step boundary after the committed `step` (the same one on every rank; not
        the last) where the preemption vote carried rank 0's `joiners_waiting`: rank 0
        admits the joined slots ready now that make a world that `fits`, and every rank
        learns it from one all-gather. When slots are admitted, the buddy copy of `step`
        completes and every rank raises `join_node.Regroup`: the next generation, with
        the joined slots, takes this state from memory. A collective."""
        if not self.joinable or self.store is None:
            return
        joiners: list[int] = []
        if dist.get_rank() == 0:  # read again: a slot found ready may have died since
            joiners = join_node.fitting(join_node.ready(self.store, self.total, self.members), self.members, fits)
            if joiners:
                join_node.admit(self.store, self.members, joiners, step)
        self._waiting = []
        if max(gather_ints(len(joiners))) == 0:
            return
        if self.buddy is not None:  # nobody died: the copy of this step completes on every rank
            if step not in self.buddy.mine:
                self.buddy.start(step, state, force=True)
            self.buddy.finish()
        raise join_node.Regroup(step)

    def attach_buddy(self, sharded: bool, every: int = 1) -> None:
        """Under a sharded strategy (each rank's state is its own: FSDP, ZeRO-1), keep a
        buddy copy (`elastic.buddy_copy`) on a gloo group of its own (CPU buffers
        whatever the training backend), made anew in each generation. Called by every
        rank at the same point of each attempt (`dt.Job.wrap`): a collective. A
        newcomer's first call creates its (empty) copy. Alone (world 1) there is no peer
        to hold a copy: none is kept (a copy sent to itself fails every step)."""
        if not sharded or dist.get_world_size() == 1:
            self.buddy = None
            return
        if self.buddy is None:
            self.buddy = BuddyCopy(every)
        if self._buddy_gen != self.gen:
            self.buddy.attach(dist.new_group(backend="gloo"))
            self._buddy_gen = self.gen
            self.publish_listeners()

    def keep(self, **objects: Any) -> None:
        """Register the attempt's objects. Registering `state` (with `acc`) says that
        they now hold the committed state, so the older in-memory copy is dropped; until
        then a failure (one during `restore`, say) keeps that copy for the next try."""
        self.live.update(objects)
        if "state" in objects:
            self.memory = None

    def cached(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self.cache:
            self.cache[name] = build()
        return self.cache[name]

    def restore(self, state) -> bool:
        """A collective of the new generation: every rank offers its committed step
        (-1 without a state); the lowest rank with the highest step broadcasts its
        state and every rank loads it into `state` (a `TrainState`). Under a sharded
        strategy the buddies hand the newcomers their shards instead
        (`BuddyCopy.restore`). Returns False when no rank holds one (the caller loads
        the disk checkpoint)."""
        # under FSDP every rank keeps a buddy copy (alone at world 1, the one survivor holds all)
        if (self.buddy is not None or self.held) and self._resharded(state):
            return True
        if self.buddy is not None:
            return self.buddy.restore(state, newcomer=not self.buddy.mine, gen=self.gen, from_world=self.from_world)
        mine = -1 if self.memory is None else int(self.memory["meta"]["step"])
        steps = gather_ints(mine)
        best = max(steps)
        fault_injection.inject("recovery", best, dist.get_rank())
        if best < 0:
            why = (
                resharded_words(self.from_world, len(steps))
                if self.from_world
                else "no rank holds the state in memory; loading the newest checkpoint"
            )
            LOGGER.info(f"{speaker()}: generation {self.gen}: {why}")
            return False
        src = steps.index(best)
        state.load_state_dict(broadcast_state(self.memory if dist.get_rank() == src else None, src))
        LOGGER.info(
            f"{speaker()}: generation {self.gen}: state of step {best} taken from rank "
            f"{src}'s memory (ranks' steps {steps})"
        )
        return True

    def _resharded(self, state) -> bool:
        """After a shrink under FSDP: the smaller world's shards from the larger world's
        buddy copies in memory (`buddy_reshard.reshard`), when every rank agrees that the
        world changed (a rank promoted into this generation held none). A collective."""
        old_world = max(int(w) for w in all_gather_json(self.from_world))
        held, self.held = self.held, {}
        return old_world > 0 and buddy_reshard.reshard(state, held, old_world, self.gen)

    def snapshot(self) -> None:
        """After a failed collective: keep this rank's committed state in memory and
        stop the attempt's watchdog. The snapshot is taken from the live objects,
        whose tensors nothing changes any more."""
        guard = self.live.get("guard")
        if guard is not None:
            guard.close()
        state, acc = self.live.get("state"), self.live.get("acc")
        self.live = {}
        if self.buddy is not None:  # the packs are the memory: no collective after a failure
            self.buddy.salvage()
            return
        if state is None or acc is None:  # the attempt did not hold the state yet: keep the older copy
            return
        state.step, state.epoch = acc.optimizer_steps, state.sampler.epoch
        self.memory = state.state_dict()


def broadcast_state(memory: dict | None, src: int) -> dict:
    """`memory` (a `TrainState.state_dict()`, given on rank `src` only) on every rank, as
    one raw buffer (`buddy_copy.pack`: the tensors' bytes back to back after a JSON
    skeleton) broadcast on the backend's device (CUDA under NCCL); nothing is pickled.
    A collective. Raises `buddy_copy.MalformedPack` on a buffer that is not a pack."""
    return unpack(broadcast_bytes(pack(memory) if memory is not None else None, src), template=None)


UNPROVEN_NCCL = (
    "disttrain: fast recovery on NCCL is unproven: its test (tests/faults/test_fast_recovery_cuda.py) "
    "needs a machine with 2 GPUs and has not run on one yet; a failed recovery falls back "
    "to torchrun's restart and the disk checkpoint."
)


def nccl_expected(backend: str, device: str) -> bool:
    """Whether the training groups will use NCCL (CUDA visible and not forced to gloo/CPU)."""
    if backend == "gloo" or device == "cpu":
        return False
    return backend == "nccl" or torch.cuda.is_available()


def current() -> Handoff | None:
    """The running attempt's `Handoff` inside `run`'s body (None elsewhere): how a
    `dt.Job` finds out that it runs under fast recovery."""
    return processes.STATE.handoff


def run(
    body: Callable[[runtime.RankInfo, Handoff], Any],
    *,
    backend: str,
    device: str,
    timeout_s: float,
    seed: int,
    prepare: Callable[[Handoff], None] | None = None,
    standby: Callable[[Handoff], None] | None = None,
) -> Any:
    """Run `body(info, handoff)` in process groups of successive generations until it
    returns. `prepare(handoff)` runs before the first group (a spare: before it waits,
    so its datasets are built while it is idle); `standby(handoff)` on a spare that has
    waited `promotion_wait.CALM_S` unpromoted (`wait_for_promotion`). The body's `dt.Job` asks for a buddy
    copy under a sharded strategy (`Handoff.attach_buddy`). The program's error (see the
    module) ends the process under `disttrain run` (SystemExit) and propagates
    elsewhere. What else ends fast recovery (this slot left out of a shrink, a generation
    that does not fill within `timeout_s`, a store that fails) takes torchrun's restart
    path under `disttrain run` (exit 1: `_to_restart`) and propagates elsewhere."""
    slot = int(os.environ["RANK"])  # torchrun's; a rank of the first generation unless a hot spare
    world = membership.training_world()
    os.environ.setdefault(TOTAL_SLOTS_ENV, os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)
    handoff = Handoff(gen=0, total=int(os.environ[TOTAL_SLOTS_ENV]), joinable=join_node.joinable())
    if nccl_expected(backend, device):
        # The survivors abort NCCL themselves (torch_compat.abort_process_groups); the NCCL
        # watchdog must not end them first.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        if int(os.environ.get("RANK", "0")) == 0:
            LOGGER.warning(UNPROVEN_NCCL)
    warm_up()
    if prepare is not None:
        prepare(handoff)
    processes.freeze_long_lived(for_life=True)  # the imports' objects: no long pause in a recovery
    store = None
    if is_spare():
        store = connect_store(timeout_s)  # connected while idle: a take-over does not wait for it
        if handoff.joinable and slot >= handoff.total:  # a joined node's slot: it may now be admitted
            if standby is not None:  # before it says it is ready: admitted at once after
                standby(handoff)
            join_node.mark_ready(store, slot)
            wait_for_promotion()
        else:
            wait_for_promotion((lambda: standby(handoff)) if standby is not None else None)
    store = store or connect_store(timeout_s)
    handoff.store = store
    job_stop.share(store, lambda: handoff.gen)  # a note that stops the job reaches every node
    if handoff.joinable and slot == 0 and os.environ.get(ROLE_ENV) == "first":
        join_node.publish(world, handoff.total)
    try:
        init = {"backend": backend, "device": device, "timeout_s": timeout_s, "seed": seed}
        result = _generations(body, handoff, slot, world, **init)
    except (UserError, SystemExit, KeyboardInterrupt):  # the user's or the program's: the launcher reports it
        job_stop.share(None)
        if not handoff.unadmitted:  # one never admitted is not the job's to count
            _count_done(store, world)
        raise
    except Exception as e:  # noqa: BLE001  (whatever ends fast recovery goes to torchrun's restart)
        job_stop.share(None)
        _to_restart(e, slot, store, world)
    job_stop.wait_for_the_others(store, len(handoff.members), timeout_s)  # a peer may still fail
    job_stop.share(None)  # the last one out removes the job's keys
    _note_dead_standby(store, world)
    _count_done(store, world)
    return result


def _generations(
    body: Callable[[runtime.RankInfo, Handoff], Any],
    handoff: Handoff,
    slot: int,
    world: int,
    **init: Any,
) -> Any:
    """`run`'s loop: join a generation, run the body in its group, recover after a
    failure and join the next. `init`: `runtime.init`'s backend, device, timeout_s and
    seed. Raises `membership.LeftOut` when this slot is no longer in the job."""
    store, timeout_s = handoff.store, init["timeout_s"]
    assert store is not None  # `run` connected it
    gen = store.add(GEN_KEY, 1) if os.environ.get(ROLE_ENV) == "newcomer" else store.add(GEN_KEY, 0)
    failure: RuntimeError | None = None
    while True:
        try:
            gen, members = join(store, gen, slot, world, timeout_s)
        except TimeoutError as timed_out:
            if failure is not None:
                raise failure from timed_out
            raise
        _take_place(handoff, members.index(slot), len(members))
        handoff.members = members
        liveness.confirm(store, [s for s in members if s != slot])  # a later refusal then means gone
        # the launcher's exit barrier and last line; a new torchrun attempt starts whole
        lost = membership.gone(store) if gen > 0 else []
        total = handoff.total
        spares, joined = [s for s in members if world <= s < total], [s for s in members if s >= total]
        worker_notes.note_shrunk(len(members), lost, spares=spares, joined=joined)
        handoff.gen = gen
        worker_notes.mark_step(0)  # a generation's start and recovery: no step in flight yet
        fault_injection.set_attempt(gen)  # a fault for attempt k fires once, in generation k
        handoff.listening = group_sockets.listeners()
        groups_store = generation_store.for_generation(store, gen, members.index(slot), members, timeout_s)
        info = runtime.init(**init, store=dist.PrefixStore(f"disttrain/fast/g{gen}/pg", groups_store))
        handoff.publish_listeners()
        processes.STATE.handoff = handoff
        try:
            return body(info, handoff)
        except join_node.Regroup:  # joined slots admitted at a step boundary: nothing failed
            handoff.snapshot()
            failure = None
        except join_node.Refused as refused:  # newcomers that differed at start: on without them
            handoff.snapshot()
            stay = membership.refuse(store, refused.slots, members)
            if info.rank == 0:
                LOGGER.warning(refused.words(len(stay)))
            failure = None
        except Exception as e:
            if slot not in membership.roster(store, world):  # whatever it raised: the job went on without it
                raise membership.LeftOut(membership.left_out_words(slot, gen)) from None
            failure = _recover(handoff, e, info)
        finally:
            processes.STATE.handoff = None
            runtime.shutdown(collect=False)
        gen = max(gen + 1, store.add(GEN_KEY, 0))


def _to_restart(e: Exception, slot: int, store: JobStore, world: int) -> NoReturn:
    """Fast recovery cannot go on for this slot: it was left out of a shrink
    (`membership.LeftOut`), a generation never filled, the store failed. Under `disttrain
    run` this rank says that it takes torchrun's restart path, notes it for the launcher
    and exits 1, a status torchrun restarts (`--max-restarts`: every worker, from the
    newest checkpoint) and the launcher does not take for the program's error; the
    traceback goes to the rank's log. Elsewhere `e` propagates."""
    if not worker_notes.under_launcher():
        _count_done(store, world)
        raise e
    where = failures.trace_to_log(slot, e, f"rank {slot}: fast recovery ended; torchrun's restart path")
    why = str(e) if isinstance(e, membership.LeftOut) else f"{type(e).__name__}: {failures.first_line(e)}"
    worker_notes.note_restart_path(slot, why)
    LOGGER.warning(
        f"disttrain run: rank {slot} leaves fast recovery ({why}); its node takes torchrun's restart path: "
        f"torchrun restarts every worker from the newest checkpoint if --max-restarts allows ({where})",
        extra=EVERY_RANK,
    )
    raise SystemExit(1) from None


def _take_place(handoff: Handoff, rank: int, world: int) -> None:
    """This process's rank and world in the generation it joined (`RANK`, `WORLD_SIZE`:
    what `runtime.init` reads). After a shrink the buddy copies of the larger world do
    not fit the new shards: they are kept by the rank they belong to (`Handoff.held`)
    for `restore` to reshard (`buddy_reshard`; else the disk checkpoint, which DCP
    reshards); under DDP every survivor holds the whole state in memory. Copies held
    so and not yet used (their generation ended before its restore: newcomers refused
    at start, a death) stay held, with their world, for this generation's."""
    before = int(os.environ["WORLD_SIZE"])
    if before != world and handoff.buddy is not None:
        handoff.from_world, handoff.held = before, handoff.buddy.held_by_rank(int(os.environ["RANK"]), before)
        handoff.buddy = None
    elif not handoff.held:
        handoff.from_world = 0
    if before != world:
        os.environ.pop(EXPECTED_WORLD_ENV, None)  # the launcher's count no longer holds
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)


def _note_dead_standby(store: JobStore, world: int) -> None:
    """With hot-spare slots (and only then: no store traffic otherwise), note for this
    node's launcher the spare nodes lost while standing by (`membership.dead_standby`).
    A store gone because a peer stopped the job is left quietly, as in `_count_done`."""
    total = int(os.environ.get(TOTAL_SLOTS_ENV, world))
    if total <= world and not join_node.joinable():
        return
    try:
        worker_notes.note_standby_lost(membership.dead_standby(store, world, total))
    except (RuntimeError, ConnectionError, TimeoutError):  # torch's DistNetworkError among them
        if not worker_notes.earlier_stop():
            raise


def _count_done(store, world: int) -> None:
    """Count this rank out on the store of a job of `world` training slots
    (`membership.finish`: the last one out under etcd removes the round's keys). When
    another rank stopped the job on purpose (a program's
    error on the rank whose slot hosts the store), the store may be gone already: this
    rank then leaves quietly, as the launcher prints that rank's error."""
    try:
        membership.finish(store, world, int(os.environ.get(TOTAL_SLOTS_ENV, world)))
    except (RuntimeError, ConnectionError, TimeoutError):  # torch's DistNetworkError among them
        if not worker_notes.earlier_stop():
            raise


def _recover(handoff: Handoff, e: Exception, info: runtime.RankInfo) -> RuntimeError:
    """After the body of generation `handoff.gen` raised `e`: stop (the program's error,
    a crash loop: SystemExit) or make ready for the next generation (keep the state,
    cut this rank's group connections). Returns `e` without its traceback, whose frames
    would keep this attempt's model alive."""
    verdict = failures.classify(e, peer_gone=handoff.peer_gone())
    store = handoff.store
    assert store is not None  # joined before any generation ran
    # a rank of another node that stopped the job wrote its note on the store (`job_stop`)
    if not verdict.retried or worker_notes.earlier_stop() or job_stop.adopt(store):
        _stop(handoff, e, info.rank)  # no new generation
    job_stop.adopt_finished(store, handoff.gen, info.world_size)  # a rank of another node ended
    if failures.report_early_finish(info.rank, _failed_step(handoff), verdict):
        worker_notes.wait_to_be_stopped()  # a peer ended its code while this rank trains
        raise SystemExit(1) from None
    _stop_a_loop(handoff, verdict, info.rank)
    # The console's one line per lost peer is its supervisor's (which rank died, how, and
    # that its spare took over); the survivor's trace goes to its log.
    failures.trace_to_log(info.rank, e, f"rank {info.rank}: generation {handoff.gen} failed; recovering in memory")
    handoff.snapshot()
    if "nccl" in str(info.backend):  # NCCL's communicators do not fail by themselves
        torch_compat.abort_process_groups()
    group_sockets.cut(group_sockets.published(store, f"disttrain/fast/g{handoff.gen}", info.world_size))
    return RuntimeError(f"{type(e).__name__}: {e}")


def _failed_step(handoff: Handoff) -> int:
    """The step in flight when the attempt failed (0: before the first)."""
    acc = handoff.live.get("acc")
    return acc.step_in_flight if acc is not None else 0


def _stop(handoff: Handoff, e: BaseException, rank: int) -> None:
    """The program's error (a `dt.Job` has already told the launcher and exited; this is
    an error outside one), or a peer's stop: the job ends, no new generation starts.
    Raises SystemExit (or `e` outside `disttrain run`)."""
    if worker_notes.earlier_stop():
        raise SystemExit(0) from None  # a peer stopped the job; the launcher reports it
    if not worker_notes.under_launcher():
        raise e
    failures.report_program_error(e, rank, _failed_step(handoff))
    worker_notes.wait_to_be_stopped()
    raise SystemExit(failures.exit_status(e)) from None


def _stop_a_loop(handoff: Handoff, verdict: failures.Verdict, rank: int) -> None:
    """The crash-loop breaker: a failure that cannot be classified (no peer died) which
    ended the generation before with the same signature stops the job (the launcher
    prints why); otherwise it is retried in memory."""
    if verdict.kind != failures.UNKNOWN:
        return
    if failures.crash_loop(verdict, _failed_step(handoff), unit="generations"):
        worker_notes.wait_to_be_stopped()
        raise SystemExit(1) from None
    failures.say_once(
        f"{speaker()}: rank {rank}: generation {handoff.gen} failed and no peer died "
        f"({verdict.cause}); recovering in memory once more"
    )
