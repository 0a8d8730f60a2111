"""Which slots are still in a fast-recovery job, so that the loss of a whole node (its
agent, its slot supervisors and their training processes at once) shrinks the job in
memory instead of waiting for a spare that will never come (docs/elastic.md).

- Every slot supervisor beats: it adds 1 to `alive/<slot>` on the job's store every
  `BEAT_S` (`beat`). A slot is a torchrun worker slot: its global rank in the first
  generation.
- A survivor whose next generation does not fill within `STALL_S` samples the beats of
  the slots that have not joined, `LEASE_S` apart, while it goes on waiting (`Watch`):
  a slot whose count did not move has lost its supervisor, so no spare will take it over (a killed
  training process is taken over by its supervisor's spare, whose slot still beats).
  A node whose process tree was killed on a host that still runs is known sooner: each
  supervisor listens on a socket of its own, which the host's kernel refuses once the
  process is gone (`elastic.liveness`), so the watch needs no lease when every probe
  answers. A machine that lost power answers none, and the lease decides.
- Hot-spare nodes (`disttrain run --spare-nodes K`): torchrun starts K more nodes,
  whose slots (global ranks from `training_world()` on) stand by: their supervisors beat
  and keep a warm spare, and train only once a roster names them (`standby`).
- The first survivor to decide (a compare-and-add on the generation's `decide` key)
  writes the generation's roster, sealed with the job's secret (`settle`): each lost
  slot's place taken by a standby slot that still beats, in order, and the places no
  standby is left for dropped (the world shrinks). Every member takes its rank from its
  place in the roster and the world from its length; later generations (and a spare
  promoted later) use the newest roster (`roster`). The slots lost so far are kept too
  (`gone`), for the launcher's exit barrier and last line.
A slot taken for gone that was only stalled finds itself outside the roster, and its
training process ends with `LeftOut`, which takes torchrun's restart path
(`fast_recovery.run`).
"""

from __future__ import annotations

import json
import os
import threading
import time

from disttrain.elastic import etcd_store, liveness
from disttrain.elastic.job_store import JobStore
from disttrain.runtime.log import EVERY_RANK, LOGGER

LEASE_ENV = "DISTTRAIN_NODE_LEASE_S"
"""`[elastic] node_lease_s`, handed to the supervisors and ranks by `disttrain run`."""
LEASE_S = 1.0
"""A supervisor silent this long is gone (5 beats: a loaded host delays a beat, not five);
`lease_s()` reads the job's own."""
STALL_S = 0.05
"""How long a generation waits for its last members before it starts watching their beats
(a killed training process's spare comes within it; watching costs a few store reads)."""
REPROBE_S = 0.05
"""How often a watch probes the missing members' supervisors again before its lease ends."""
TRAINING_WORLD_ENV = "DISTTRAIN_TRAINING_WORLD"
"""The slots that train from the start (`--nnodes` x `--nproc`); torchrun's slots past it
are hot spares (`--spare-nodes`). Set by `disttrain run` only when there are spares."""
ROSTER_KEY = "disttrain/fast/roster"
GONE_KEY = "disttrain/fast/gone"
JOINED_KEY = "disttrain/fast/joined"
"""How many slots nodes that joined the running job have taken (`elastic.join_node`):
theirs are numbered from torchrun's slot count on, after the hot spares'."""
LOST_KEY = "disttrain/fast/lost"
"""How many places the job has dropped (no spare took them): the store's host waits for
the others to finish."""


def lease_s() -> float:
    """The job's lease (`LEASE_ENV`), else `LEASE_S`; out-of-range values are not used."""
    try:
        value = float(os.environ.get(LEASE_ENV, ""))
    except ValueError:
        return LEASE_S
    return value if 0.2 <= value <= 60 else LEASE_S


def beat_s() -> float:
    """How often a supervisor beats: five beats a lease."""
    return lease_s() / 5


def training_world() -> int:
    """The slots that train from the start (`TRAINING_WORLD_ENV`, else torchrun's WORLD_SIZE)."""
    total = int(os.environ["WORLD_SIZE"])
    try:
        value = int(os.environ.get(TRAINING_WORLD_ENV, total))
    except ValueError:
        return total
    return value if 0 < value <= total else total


class LeftOut(RuntimeError):
    """This slot was taken for gone (its supervisor stalled past the lease) and the
    others went on without it."""


def left_out_words(slot: int, gen: int) -> str:
    """What `LeftOut` says for `slot`, found outside generation `gen`'s roster."""
    return (
        f"rank {slot} was taken for gone in generation {gen} (its supervisor missed its beats for "
        f"{lease_s():g} s) and the job went on without it"
    )


def beat(store: JobStore, slot: int, stop: threading.Event) -> None:
    """Beat for `slot` until `stop` is set, the store is gone, or the round's keys were
    removed (the job is over: `finish`; a beat must not bring a key back)."""
    period, key, beats = beat_s(), f"disttrain/fast/alive/{slot}", 0
    while not stop.wait(period):
        try:
            count = store.add(key, 1)
            beats += 1
            if count < beats:  # the counter started over: the round's keys were removed, the job is over
                getattr(store.store, "remove_all", lambda: store.store.delete_key(key))()
                return
        except (RuntimeError, ConnectionError, TimeoutError, OSError):
            return  # the store is gone (the job is over, or its host died)


def roster(store: JobStore, world: int) -> list[int]:
    """The slots in the job now, in rank order (all `world` of them until a shrink)."""
    text = store.get(ROSTER_KEY)
    return list(range(world)) if text is None else [int(s) for s in json.loads(text)]


def await_roster(store: JobStore, timeout_s: float) -> None:
    """Return once the roster changes after this store's last `roster` read, or after
    `timeout_s`. On the etcd that is one watch, so a standby slot is promoted as soon as a
    roster names it, not at its next poll; on a TCP store (which has no watch) a sleep."""
    if isinstance(store.store, etcd_store.EtcdStore):
        store.store.wait_for_change(ROSTER_KEY, timeout_s)
    else:
        time.sleep(timeout_s)


def gone(store: JobStore) -> list[int]:
    """The slots the job has lost with their supervisors so far (replaced or dropped)."""
    text = store.get(GONE_KEY)
    return [] if text is None else [int(s) for s in json.loads(text)]


REFUSED_KEY = "disttrain/fast/refused"
"""The slots new to the job that were not admitted: they differed from it at start
(`refuse`)."""


def refused(store: JobStore) -> list[int]:
    """The slots refused so far (`refuse`): never admitted again, never waited for."""
    text = store.get(REFUSED_KEY)
    return [] if text is None else [int(s) for s in json.loads(text)]


def refuse(store: JobStore, slots: list[int], members: list[int]) -> list[int]:
    """After a generation whose newcomers `slots` differed from the running job at start
    (`fast_recovery.Handoff.refuse_newcomers`): the roster without them, and the slots
    refused so far with them. Every rank that stays writes the same values, so each
    joins the next generation with it, whichever writes first. Returns the roster."""
    stay = [s for s in members if s not in slots]
    store.set(ROSTER_KEY, json.dumps(stay))
    store.set(REFUSED_KEY, json.dumps(sorted(set(refused(store)) | set(slots))))
    return stay


def all_slots(store: JobStore, total: int) -> int:
    """Every slot number the job has given: torchrun's `total`, then the joined nodes'."""
    return total + store.add(JOINED_KEY, 0)


def standby_slots(store: JobStore, world: int, total: int) -> list[int]:
    """The hot-spare slots (`world` .. `total`) and the joined nodes' slots that are in no
    roster, not gone and not refused."""
    taken = set(roster(store, world)) | set(gone(store)) | set(refused(store))
    return [s for s in range(world, all_slots(store, total)) if s not in taken]


DONE_KEY = "disttrain/fast/done"
"""Each training process adds 1 when the job is over (`finish`)."""
STANDBY_DONE_KEY = "disttrain/fast/standby_done"
"""Each hot-spare slot still standing by when the job is over adds 1 (`finish`)."""


def everyone_done(store: JobStore, world: int, total: int) -> bool:
    """Whether every slot in the roster and every standby slot has counted itself out."""
    return store.add(DONE_KEY, 0) >= len(roster(store, world)) and store.add(STANDBY_DONE_KEY, 0) >= len(
        standby_slots(store, world, total)
    )


def finish(store: JobStore, world: int, total: int, standby: bool = False) -> None:
    """Count this slot out at the job's end (a training process, or a `standby` slot),
    and, when it is the last to do so, remove the round's keys from a store that keeps
    them after the job (etcd: the TCP store goes with its host, `slot_supervisor`). A
    standby slot counts itself out only after every training process has, so the last
    one out is always one of these."""
    store.add(STANDBY_DONE_KEY if standby else DONE_KEY, 1)
    remove = getattr(store.store, "remove_all", None)
    if remove is not None and everyone_done(store, world, total):
        remove()


DEAD_STANDBY_KEY = "disttrain/fast/dead_standby"


def dead_standby(store: JobStore, world: int, total: int) -> list[int]:
    """At the job's end, before this training rank counts itself out (so every hot-spare
    slot still stands by and beats): the standby slots whose supervisors did not beat
    during one lease, their nodes lost while standing by, added to those the other ranks
    found (sealed, `DEAD_STANDBY_KEY`). Every launcher's exit barrier must not wait for
    those nodes' agents (`worker_notes.note_standby_lost`). [] without standby slots, at once."""
    standby = standby_slots(store, world, total)
    if not standby:
        return []
    before = _beats(store, standby)
    time.sleep(lease_s())
    dead = {s for s, a, b in zip(standby, before, _beats(store, standby), strict=True) if a == b}
    if dead:
        store.set(DEAD_STANDBY_KEY, json.dumps(sorted(dead | set(found_dead_standby(store)))))
    return found_dead_standby(store)


def found_dead_standby(store: JobStore) -> list[int]:
    """The standby slots the training ranks found dead at the job's end (`dead_standby`)."""
    text = store.get(DEAD_STANDBY_KEY)
    return [] if text is None else [int(s) for s in json.loads(text)]


def _beats(store: JobStore, slots: list[int]) -> list[int]:
    return [store.add(f"disttrain/fast/alive/{s}", 0) for s in slots]


class Watch:
    """The beats of a stalled generation's missing members and of the standby slots,
    sampled now and compared a lease later (`lost`, `fresh`), while the caller goes on
    waiting for the members. The supervisors are also probed (`elastic.liveness`): when
    every missing member's supervisor is refused (its process tree is gone) and every
    standby slot answered, `lost` needs no lease."""

    def __init__(self, store: JobStore, gen: int, members: list[int], standby: list[int] | None = None) -> None:
        self.store, self.gen = store, gen
        self.missing = [s for s in members if store.add(f"disttrain/fast/g{gen}/in/{s}", 0) == 0]
        self.standby = list(standby or [])
        self.before = _beats(store, self.missing + self.standby)
        self.since = time.monotonic()
        self.fresh: list[int] = []
        """After `lost` returned a list: the standby slots that beat during the lease."""
        self.refused = False
        """Whether `lost` named the members whose supervisors refused a probe (no lease)."""
        self.probes = ""
        """After the lease decided: what the last probes of the lost members found."""
        self._probed = time.monotonic()
        self._early = _refused(store, self.missing, self.before, self.standby)

    def lost(self) -> list[int] | None:
        """None until a lease has passed; then the missing members that have beaten
        before but not since (`[]`: none is gone, a spare or a slow rank is coming).
        Before the lease, the members whose supervisors refused the probe, when the
        probes (again every `REPROBE_S`) decided (`_refused`)."""
        if self._early is None and time.monotonic() - self._probed >= REPROBE_S:
            self._probe_again()
        if self._early is not None:
            gone_now, self.fresh = self._early
            self._early, self.refused = None, True
            return gone_now
        if time.monotonic() - self.since < lease_s():
            return None
        after = _beats(self.store, self.missing + self.standby)
        moved = [b != a for a, b in zip(self.before, after, strict=True)]
        n = len(self.missing)
        self.fresh = [s for s, m in zip(self.standby, moved[n:], strict=True) if m]
        gone_now = [s for s, a, m in zip(self.missing, self.before, moved, strict=False) if a > 0 and not m]
        self.probes = "; ".join(f"rank {s}: {liveness.said(s)}" for s in gone_now)
        return gone_now

    def cause(self) -> str:
        """Why `lost` named its members, in words: a refused probe, or the lease (with
        what the probes found instead)."""
        if self.refused:
            return "their node refused a connection to them: its processes are gone"
        return lease_cause(self.probes)

    def _probe_again(self) -> None:
        """Probe the members still missing: a node's processes do not all die at once (one
        may still have run at the last probe), and a slow survivor may have arrived since."""
        self._probed = time.monotonic()
        beats = dict(zip(self.missing, self.before, strict=False))
        still = [s for s in self.missing if self.store.add(f"disttrain/fast/g{self.gen}/in/{s}", 0) == 0]
        self._early = _refused(self.store, still, [beats[s] for s in still], self.standby)


def _refused(
    store: JobStore, missing: list[int], beats: list[int], standby: list[int]
) -> tuple[list[int], list[int]] | None:
    """(the missing members, the standby slots whose supervisors accept a connection) when
    every missing member has beaten and its supervisor refuses a connection, and every
    standby slot answered; else None: a later probe or the lease decides. Never some of
    the missing members only: a member of a dying node left in the roster would cost the
    generation a second round of `settle`."""
    if not missing:
        return None
    answers = liveness.probe(store, missing + standby)
    refused = [s for s, b in zip(missing, beats, strict=False) if b > 0 and answers[s] is liveness.GONE]
    if len(refused) < len(missing) or any(answers[s] is None for s in standby):
        return None
    return refused, [s for s in standby if answers[s] is liveness.ALIVE]


def arrive(store: JobStore, gen: int, slot: int) -> None:
    """Say that `slot` has joined generation `gen` (before its join counter)."""
    store.add(f"disttrain/fast/g{gen}/in/{slot}", 1)


def decided(store: JobStore, gen: int) -> list[int] | None:
    """Generation `gen`'s roster, once a survivor has decided one (None: not shrunk)."""
    text = store.get(f"disttrain/fast/g{gen}/roster")
    return None if text is None else [int(s) for s in json.loads(text)]


def replaced(members: list[int], lost: list[int], standby: list[int]) -> list[int]:
    """The roster after `lost`: each lost slot's place taken by the next of `standby`, in
    order, and the places none is left for dropped."""
    spares = iter(standby)
    after = [s if s not in lost else next(spares, None) for s in members]
    return [s for s in after if s is not None]


def settle(
    store: JobStore,
    gen: int,
    members: list[int],
    lost: list[int],
    gen_key: str,
    standby: list[int] | None = None,
    cause: str = "",
) -> list[int]:
    """Generation `gen` of `members` (its roster as last decided) goes on without `lost`,
    the standby slots that beat (`standby`) taking their places (`replaced`): the roster,
    decided by the first survivor to get here (a compare-and-add) and read by the others.
    A generation is settled in rounds: a member found gone after a round (it died while
    the others waited for the spares) starts the next one, so it never holds the
    generation until its timeout. The decider also moves the generation counter
    `gen_key` up to `gen` (the survivors joined it without a newcomer's bump), so a spare
    promoted later starts the next one. `cause`: why they are lost (`Watch.cause`), for
    the console's line."""
    settled = f"disttrain/fast/g{gen}/settled"
    round_ = store.add(settled, 0)
    current = decided(store, gen) if round_ else None
    if current is not None and not set(lost) & set(current):
        return current  # an earlier round already dropped them
    if store.add(f"disttrain/fast/g{gen}/decide/{round_}", 1) == 1:
        members = current or members  # the roster as the last round left it
        lost = [s for s in lost if s in members]
        store.add(gen_key, max(0, gen - store.add(gen_key, 0)))
        stay = replaced(members, lost, standby or [])
        store.set(GONE_KEY, json.dumps(sorted(set(gone(store)) | set(lost))))
        store.set(ROSTER_KEY, json.dumps(stay))
        store.add(LOST_KEY, len(members) - len(stay))
        store.set(f"disttrain/fast/g{gen}/roster", json.dumps(stay))
        store.add(settled, 1)
        LOGGER.warning(f"disttrain run: {settled_words(members, lost, stay, gen, cause)}", extra=EVERY_RANK)
        return stay
    deadline = time.monotonic() + 30
    while store.add(settled, 0) <= round_:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {gen}: the survivor that decides its roster did not write it")
        time.sleep(0.01)
    return decided(store, gen) or members


def lease_cause(probes: str = "") -> str:
    """Why members are lost when the lease decided, with what the probes found instead."""
    return f"no beat for {lease_s():g} s: a node is gone" + (f"; the probes found {probes}" if probes else "")


def settled_words(members: list[int], lost: list[int], stay: list[int], gen: int, cause: str = "") -> str:
    """The console's one line on a roster `settle` decided; `cause`: `Watch.cause`
    (`lease_cause` when none is given)."""
    head = f"rank(s) {lost} lost with their supervisors ({cause or lease_cause()})"
    spares = [s for s in stay if s not in members]
    if not spares:
        return f"{head} and no spare takes them; the job goes on in memory at world {len(stay)} (generation {gen})"
    took = f"{head}; hot-spare slot(s) {spares} take their places"
    if len(stay) == len(members):
        return f"{took} and the job goes on in memory at world {len(stay)} (generation {gen})"
    return f"{took}, too few for all: the job goes on in memory at world {len(stay)} (generation {gen})"
