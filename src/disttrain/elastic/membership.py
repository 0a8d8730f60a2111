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
- The first survivor to decide (a compare-and-add on the generation's `decide` key)
  writes the generation's roster: the slots that stay, in rank order, sealed with the
  job's secret (`settle`). Every member takes its rank from its place in the roster
  and the world from its length; later generations (and a spare promoted later) use
  the newest roster (`roster`).
A slot taken for gone that was only stalled finds itself outside the roster, and its
training process ends with `LeftOut`, which takes torchrun's restart path
(`fast_recovery.run`).
"""

from __future__ import annotations

import json
import threading
import time

from disttrain.elastic.job_store import JobStore
from disttrain.runtime.log import EVERY_RANK, LOGGER

BEAT_S = 0.2
LEASE_S = 1.0
"""A supervisor silent this long is gone (5 beats: a loaded host delays a beat, not five)."""
STALL_S = 0.3
"""How long a generation waits for its last members before it asks who is gone."""
ROSTER_KEY = "disttrain/fast/roster"
LOST_KEY = "disttrain/fast/lost"
"""How many slots the job has lost (the store's host waits for the others to finish)."""


class LeftOut(RuntimeError):
    """This slot was taken for gone (its supervisor stalled past the lease) and the
    others went on without it."""


def left_out_words(slot: int, gen: int) -> str:
    """What `LeftOut` says for `slot`, found outside generation `gen`'s roster."""
    return (
        f"rank {slot} was taken for gone in generation {gen} (its supervisor missed its beats for "
        f"{LEASE_S:g} s) and the job went on without it"
    )


def beat(store: JobStore, slot: int, stop: threading.Event) -> None:
    """Beat for `slot` until `stop` is set or the store is gone."""
    while not stop.wait(BEAT_S):
        try:
            store.add(f"disttrain/fast/alive/{slot}", 1)
        except (RuntimeError, ConnectionError, TimeoutError, OSError):
            return  # the store is gone (the job is over, or its host died)


def roster(store: JobStore, world: int) -> list[int]:
    """The slots in the job now, in rank order (all `world` of them until a shrink)."""
    text = store.get(ROSTER_KEY)
    return list(range(world)) if text is None else [int(s) for s in json.loads(text)]


def _beats(store: JobStore, slots: list[int]) -> list[int]:
    return [store.add(f"disttrain/fast/alive/{s}", 0) for s in slots]


class Watch:
    """The beats of a stalled generation's missing members, sampled now and compared
    `LEASE_S` later (`lost`), while the caller goes on waiting for them."""

    def __init__(self, store: JobStore, gen: int, members: list[int]) -> None:
        self.store = store
        self.missing = [s for s in members if store.add(f"disttrain/fast/g{gen}/in/{s}", 0) == 0]
        self.before = _beats(store, self.missing)
        self.since = time.monotonic()

    def lost(self) -> list[int] | None:
        """None until `LEASE_S` has passed; then the missing members that have beaten
        before but not since (`[]`: none is gone, a spare or a slow rank is coming)."""
        if time.monotonic() - self.since < LEASE_S:
            return None
        after = _beats(self.store, self.missing)
        return [s for s, a, b in zip(self.missing, self.before, after, strict=True) if a > 0 and a == b]


def arrive(store: JobStore, gen: int, slot: int) -> None:
    """Say that `slot` has joined generation `gen` (before its join counter)."""
    store.add(f"disttrain/fast/g{gen}/in/{slot}", 1)


def decided(store: JobStore, gen: int) -> list[int] | None:
    """Generation `gen`'s roster, once a survivor has decided one (None: not shrunk)."""
    text = store.get(f"disttrain/fast/g{gen}/roster")
    return None if text is None else [int(s) for s in json.loads(text)]


def settle(store: JobStore, gen: int, members: list[int], lost: list[int], gen_key: str) -> list[int]:
    """Generation `gen` of `members` goes on without `lost`: the roster, decided by the
    first survivor to get here (a compare-and-add) and read by the others. The decider
    also moves the generation counter `gen_key` up to `gen` (the survivors joined it
    without a newcomer's bump), so a spare promoted later starts the next one."""
    if store.add(f"disttrain/fast/g{gen}/decide", 1) == 1:
        store.add(gen_key, max(0, gen - store.add(gen_key, 0)))
        stay = [s for s in members if s not in lost]
        store.set(ROSTER_KEY, json.dumps(stay))
        store.add(LOST_KEY, len(lost))
        store.set(f"disttrain/fast/g{gen}/roster", json.dumps(stay))
        LOGGER.warning(
            f"disttrain run: rank(s) {lost} lost with their supervisors (no beat for {LEASE_S:g} s: "
            f"a node is gone) and no spare takes them; the job goes on in memory at world "
            f"{len(stay)} (generation {gen})",
            extra=EVERY_RANK,
        )
        return stay
    deadline = time.monotonic() + 30
    while (written := decided(store, gen)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {gen}: the survivor that decides its roster did not write it")
        time.sleep(0.01)
    return written
