"""A job's end, told to the other nodes on torchrun's own rendezvous.

When a rank's note stops a node (the program's error, a user error, a crash loop:
`launch.notes_watch`), its launcher stops its workers on a SIGTERM to itself, and
torchrun leaves the rendezvous open after a signal (a preempted node may come back).
The other nodes' ranks then lose a peer, their agents restart them into a rendezvous
that this node never joins again, and each waits the join timeout (2 min) before a
traceback. Instead the stopped node marks the rendezvous closed (`close`: the
handler's public `set_closed`), which is how torch says that a job is over: an agent
in or entering a rendezvous of a closed one ends at its next poll (about 1 s), and a
launcher whose ranks lost a peer asks `closed` before it blames them. As after any
job's end in torch, the run id's rendezvous then stays closed (under etcd, for hours):
a later job needs its own `--rdzv-id`, and one refused at its first round says so
(`Seen.rounds`). What the stopped node's rank said reaches the others through
`elastic.note_relay` when the job has a secret.

`captured()` keeps the handlers torchrun makes in this process (one per launch) by
wrapping `registry.get_rendezvous_handler`, a public function, for the launch, and
each handler's `shutdown` (torchrun closes the rendezvous itself when it gives up on
failed workers, so the question is asked just before) and `next_rendezvous` (the
rounds it completes). Under the static rendezvous (no endpoint) the handler has no
shared state: closing and asking do nothing there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disttrain.runtime.log import LOGGER

if TYPE_CHECKING:
    from disttrain.elastic import note_relay

CLOSED_POLL_S = 0.25
CLOSED_WAIT_S = 5.0
"""How long a node whose ranks lost a peer waits for the other node to close the
rendezvous: that node closes it once its own workers stopped (well under a second)."""


@dataclass
class Seen:
    """What a launch saw of its rendezvous: where it is (from the launch's flags),
    torchrun's handlers, the round its agent was last in, and whether another node had
    closed it before this node's agent closed it on its own way out."""

    backend: str | None = None
    endpoint: str | None = None
    run_id: str = "none"
    nnodes: str | None = None
    """torchrun's `--nnodes` as given (`N` or `MIN:MAX`)."""
    round: str | None = None
    """The last round's store address (`RendezvousInfo.bootstrap_store_info`): the same
    on every node of the round, another one in each round and each job."""
    handlers: list[Any] = field(default_factory=list)
    closed_by_another: bool = False
    rounds: int = 0
    """The rendezvous rounds this node's agent completed: none when a closed one refused it
    at the first (an earlier job with the same run id ended there)."""

    def where(self) -> note_relay.Where:
        """The round this node's agent was last in, for `elastic.note_relay`."""
        from disttrain.elastic import note_relay

        return note_relay.Where(self.backend, self.endpoint, self.run_id, self.round)


@contextlib.contextmanager
def captured(seen: Seen, lost_peer: Callable[[], bool]) -> Iterator[Seen]:
    """Within the block, every rendezvous handler torchrun makes is kept in `seen`, which
    counts the rounds it completes and keeps the last one's store address.
    torchrun's agent closes the rendezvous itself when it gives up on failed workers;
    when `lost_peer()` says that this node's ranks only lost a peer, its handler first
    asks, for up to `CLOSED_WAIT_S`, whether another node closed it (`closed_by_another`)."""
    from torch.distributed.elastic.rendezvous import registry

    original = registry.get_rendezvous_handler

    def keep(params: Any) -> Any:
        handler = original(params)
        own_shutdown, own_next = handler.shutdown, handler.next_rendezvous

        def next_rendezvous() -> Any:
            info = own_next()
            seen.rounds += 1
            store_info = getattr(info, "bootstrap_store_info", None)
            if store_info is not None:
                seen.round = f"{store_info.master_addr}_{store_info.master_port}"
            return info

        def shutdown() -> bool:
            if lost_peer():
                seen.closed_by_another = closed([handler], CLOSED_WAIT_S)
            return own_shutdown()

        setattr(handler, "shutdown", shutdown)  # noqa: B010  (mypy refuses a method assigned)
        setattr(handler, "next_rendezvous", next_rendezvous)  # noqa: B010
        seen.handlers.append(handler)
        return handler

    registry.get_rendezvous_handler = keep
    try:
        yield seen
    finally:
        registry.get_rendezvous_handler = original


def close(handlers: list[Any]) -> None:
    """Mark each handler's rendezvous closed; a failure (the store or etcd gone with
    another node) is logged and left: the others then wait their join timeout."""
    for handler in handlers:
        try:
            handler.set_closed()
        except Exception as e:  # any backend's error: the job ends either way
            LOGGER.debug(f"disttrain run: could not close the rendezvous: {type(e).__name__}: {e}")


def closed(handlers: list[Any], wait_s: float) -> bool:
    """Whether another node closed the rendezvous, asked until `wait_s` has passed (its
    launcher closes it once its own workers stopped, after this node's ranks saw the
    loss). False when it cannot be asked."""
    deadline = time.monotonic() + wait_s
    while True:
        for handler in handlers:
            try:
                if handler.is_closed():
                    return True
            except Exception:  # a rendezvous that cannot be asked is not known closed
                return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(CLOSED_POLL_S)
