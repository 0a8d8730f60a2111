"""How `disttrain run` ends a launch that did not end cleanly: which last line and exit
status apply (a rank's note, a hang, a slot that left fast recovery, another node's stop,
a rendezvous that closed, vanished or did not fill, a signal from outside), and the
lines of an etcd outage under a running job. The words are `launch.end_lines`'; this
module decides which apply. torch's exception types are imported where they are needed."""

from __future__ import annotations

import signal
import sys
from typing import Any

from disttrain.launch import notes_watch
from disttrain.launch.end_lines import (
    closed_by_another_line,
    hang_line,
    others_clause,
    rendezvous_gone_line,
    rendezvous_reused_line,
    rendezvous_timeout_line,
    restart_path_line,
    stopped_by_signal,
)
from disttrain.launch.rendezvous_end import Seen


def say_outage(endpoint: str, error: BaseException | None) -> None:
    """One line when the job's etcd stops answering a running job, one when it is back."""
    if error is None:
        print(f"disttrain run: the etcd at {endpoint} answers again.", file=sys.stderr, flush=True)
        return
    print(
        f"disttrain run: the etcd at {endpoint} does not answer; training goes on, but no node can "
        f"join or be replaced until it does (start it again on the same address and data directory).",
        file=sys.stderr,
        flush=True,
    )


def child_failed(e: Any, notes: notes_watch.Notes, closed_by_another: bool) -> int:
    """The last line and status of a job whose agent gave up on its failed workers
    (torchrun's `ChildFailedError`)."""
    if notes.stopped():
        return notes.report()
    rank, failure = e.get_first_failure()
    code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"
    hang = notes.hang() if failure.exitcode == 124 else None  # watchdog.HANG_EXIT_CODE
    if hang is not None:
        print(f"disttrain run: {hang_line(hang)}", file=sys.stderr)
        return failure.exitcode
    left = notes.restart_path()
    if left is not None and left.get("rank") == rank:
        print(f"disttrain run: {restart_path_line(left, restarted=False)}", file=sys.stderr)
        return code or 1
    if closed_by_another:
        print(f"disttrain run: {closed_by_another_line(notes.lost_peer_ranks())}", file=sys.stderr)
        return code or 1
    more = others_clause(e.failures, rank, notes.lost_peer_ranks())
    print(
        f"disttrain run: rank {rank} failed first with {how}{more}. "
        f"Its error is above; per-rank logs: --log-dir DIR --tee 3.",
        file=sys.stderr,
    )
    return code or 1


def rendezvous_failed(e: Exception, notes: notes_watch.Notes, rendezvous: Seen) -> int:
    """The last line of a node whose agent could not go on with its rendezvous: closed by
    another node (its rank stopped the job) or, before this node completed any round, by
    an earlier job with the same run id; no longer answering; or not filled."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    if isinstance(e, RendezvousClosedError) and rendezvous.rounds == 0:
        line = rendezvous_reused_line(rendezvous.run_id, rendezvous.endpoint)
    elif isinstance(e, RendezvousClosedError):  # torchrun restarted this node's ranks into a stopped job
        line = closed_by_another_line(notes.lost_peer_ranks())
    elif isinstance(e, RendezvousConnectionError):  # c10d's store went with the node that hosts it
        line = rendezvous_gone_line(rendezvous.endpoint, rendezvous.backend)
    elif isinstance(e, RendezvousTimeoutError):
        line = rendezvous_timeout_line(rendezvous.nnodes)
    else:
        raise e
    print(f"disttrain run: {line}", file=sys.stderr)
    return 1


def signalled(sigval: int, notes: notes_watch.Notes) -> int:
    """The last line and status of a job whose launcher got a signal from outside.
    torchrun has already passed it on and waited --shutdown-timeout for the workers; a
    SIGTERMed disttrain worker saves and exits 0, so the job says so and exits 0 too
    (the requeue path of docs/elastic.md), instead of a traceback and exit 1."""
    if notes.stood_by() and notes.saved_step() is None:
        print(
            f"disttrain run: stopped by {signal.Signals(sigval).name}; this node's slots were hot spares "
            f"standing by, with nothing to save.",
            file=sys.stderr,
        )
        return 0
    line, status = stopped_by_signal(sigval, notes.saved_step(), notes.failed_attempts())
    print(line, file=sys.stderr)
    return status
