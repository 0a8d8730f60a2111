"""Each rank's synchronising events, numbered per process group and compared across the
group's ranks through a store, never through a collective: a rank that is missing
cannot deadlock the comparison; it is waited for up to a bound (`wait_bound_s`).

The store is a client of the job's TCPStore at MASTER_ADDR:MASTER_PORT (under `disttrain
run`: the store of the default group's rendezvous, or torchrun's agent store) on a
connection of its own, so a wait here never holds the one the process group uses. Its
keys, under the prefix "disttrain-check/": "{group}/{n}/{rank}" holds the rank's n-th
event in the group (`fingerprints.Event` as JSON), or `OFF`: the rank stopped comparing
before its n-th event, and its peers stop too, at that place, without a message.

`exchange` sets this rank's key, then reads every member's key of the same place in one
`multi_get`, whose wait is bounded by the store's timeout. Once every member has set
its n-th key, each has read the keys of n-1: this rank then deletes its own key of n-1,
so the store holds at most two places per rank and group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from disttrain.check.fingerprints import Event

WAIT_ENV = "DISTTRAIN_CHECK_WAIT_S"
"""Seconds a rank waits at one place of its sequence for the other ranks' events."""
DEFAULT_WAIT_S = 60.0
CONNECT_S = 10.0
"""The longest wait to connect to the store (it is there once the process group is up)."""
PREFIX = "disttrain-check/"
OFF = b"off"


def wait_bound_s(env: dict | None = None) -> float:
    """The bound of one wait: DISTTRAIN_CHECK_WAIT_S (seconds > 0), else 60."""
    raw = (os.environ if env is None else env).get(WAIT_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_WAIT_S
    return value if 0 < value < float("inf") else DEFAULT_WAIT_S


def connect(bound_s: float) -> Any:
    """A client of the job's store, whose waits end after `bound_s`. Raises `OSError`,
    `RuntimeError` (a `DistError`) or `KeyError` when there is none to reach."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Nothing listening (a group set up from another address): refused at once, rather
    # than the client's retries until its timeout.
    socket.create_connection((host, port), timeout=min(CONNECT_S, bound_s)).close()
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(CONNECT_S, bound_s)))
    store.set_timeout(timedelta(seconds=bound_s))
    return dist.PrefixStore(PREFIX, store)


@dataclass(frozen=True)
class Missing:
    """An exchange that waited out its bound: the members that had not reached the
    place, and the event each had reached before it (None: unknown, or none)."""

    ranks: list[int]
    last: dict[int, Event | None]


class Sequence:
    """This rank's places in each group's sequence, and the store they are compared on."""

    def __init__(self, rank: int, bound_s: float, store: Any = None) -> None:
        self.rank, self.bound_s = rank, bound_s
        self.store = store
        """None until the first exchange connects (`connect`)."""
        self.places: dict[str, int] = {}

    def _key(self, group: str, place: int, rank: int) -> str:
        return f"{group}/{place}/{rank}"

    def exchange(self, group: str, members: list[int], value: bytes) -> list[Event | None] | Missing | None:
        """Post `value` (an event's JSON) as this rank's next event in `group` and return
        every member's event at that place, in `members` order (None for a value that is
        not an event); `Missing` when some had not posted it within the bound; None when
        a member had stopped comparing (`OFF`). Raises `RuntimeError` when the store
        fails (a peer that hosted it is gone)."""
        if self.store is None:
            self.store = connect(self.bound_s)
        place = self.places[group] = self.places.get(group, 0) + 1
        keys = [self._key(group, place, r) for r in members]
        self.store.set(self._key(group, place, self.rank), value)
        try:
            values = self.store.multi_get(keys)
        except dist.DistStoreError:
            absent = [r for r, key in zip(members, keys, strict=True) if not self.store.check([key])]
            if not absent:
                raise  # the keys are there: the wait failed for another reason
            return Missing(absent, {r: self._last(group, place, r) for r in absent})
        if place > 1:
            self.store.delete_key(self._key(group, place - 1, self.rank))
        if any(v == OFF for v in values):
            return None
        return [Event.from_json(v) for v in values]

    def _last(self, group: str, place: int, rank: int) -> Event | None:
        key = self._key(group, place - 1, rank)
        if place == 1 or not self.store.check([key]):
            return None
        return Event.from_json(self.store.get(key))

    def leave(self, value: bytes, groups: list[str]) -> None:
        """Post `value` (`OFF`, or an end event) at this rank's next place in every
        group it has used and in `groups`, without waiting: a peer that reaches that
        place reads it instead of waiting. Never raises."""
        if self.store is None:
            return
        for group in {*self.places, *groups}:
            try:
                self.store.set(self._key(group, self.places.get(group, 0) + 1, self.rank), value)
            except RuntimeError:
                return
