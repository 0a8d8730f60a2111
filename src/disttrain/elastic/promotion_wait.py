"""How a warm spare of fast recovery waits for its promotion (`elastic.fast_recovery`):
its slot supervisor writes one line on the spare's input when the slot's training
process dies. While it waits, a spare may do standby work (a rehearsal of its first
sharded step: `train.spare_rehearsal`), which a promotion interrupts at once through
SIGUSR1, except where the work must not stop half done (`promotion_deferred`).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

CALM_S = 3.0
"""How long a spare waits unpromoted before its `standby` work: a spare started in a
recovery (its slot's last one took over) must not take the CPU from the recovery."""


def wait(standby: Callable[[], None] | None = None) -> None:
    """Block until the supervisor says this spare takes over (one line on stdin);
    `standby` runs once the spare has waited `CALM_S` unpromoted, and a promotion during
    it cuts it short (`_until_promoted`). End of input (the job is over, or the
    supervisor died): exit 0 at once."""
    if standby is not None and not select.select([sys.stdin], [], [], CALM_S)[0]:
        _until_promoted(standby)
    if not sys.stdin.readline():
        os._exit(0)


class _Promoted(BaseException):
    """Raised in the main thread when a promotion arrives during a spare's standby work."""


def _until_promoted(work: Callable[[], None]) -> None:
    """Run `work` on this (the main) thread until it returns or input arrives on stdin (a
    promotion, or its end), whichever is first: a thread watches stdin and, on input,
    interrupts `work` with `_Promoted` through SIGUSR1 (Python runs a signal's handler
    on the main thread between two bytecodes, so a torch operator in flight finishes
    first). The input is left for the caller to read."""
    lock, finished = threading.Lock(), threading.Event()
    main = threading.get_ident()

    def watch() -> None:
        while not finished.is_set():
            ready = select.select([sys.stdin], [], [], 0.02)[0]
            with lock:
                if ready and not finished.is_set():
                    finished.set()
                    signal.pthread_kill(main, signal.SIGUSR1)

    def promoted(_signum, _frame) -> None:
        raise _Promoted

    before = signal.signal(signal.SIGUSR1, promoted)
    watcher = threading.Thread(target=watch, name="disttrain-promotion-watch", daemon=True)
    watcher.start()
    try:  # a _Promoted raised anywhere in here, the lock's wait included, is caught below
        work()
        with lock:
            finished.set()
    except _Promoted:
        pass
    finally:
        watcher.join()
        signal.signal(signal.SIGUSR1, before)


@contextmanager
def promotion_deferred() -> Iterator[None]:
    """A promotion that arrives inside the block (`_until_promoted`'s SIGUSR1, blocked on
    this thread meanwhile) interrupts the spare's standby work only once the block has
    ended: for what must not be left half done, such as starting or destroying a
    rehearsal's process group (a default group left behind would be taken for the
    real one, and the generation would wait for this rank forever)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
