"""What a `dt.Job` does with the exception that ends its `with` block under `disttrain
run`, by the verdict of `runtime.failures` (docs/elastic.md "What is retried and what
is not"):

- a user's mistake (`UserError`): one line from the launcher, exit 2 (as before);
- a rank whose peer stopped the job on purpose (a user error, a program's error, a
  crash loop: the peer's note is there): exit 0 at once, silent;
- the program's error on the rank that raised it: the traceback and one line
  ("not retried: RuntimeError at step 12 on rank 1 is the program's error") go to the
  launcher, which stops the job without a restart and in-memory recovery starts no
  new generation; an out-of-memory error's line adds the planner's estimate and the
  fixes;
- the machine's failure (a lost peer) on the restart path: one line (which rank, at
  which step, what happens next), the full traceback to the rank's log
  (`worker_notes.trace_file`), exit 1 for torchrun to restart; under fast recovery
  the exception goes on to `fast_recovery.run`, which recovers in memory;
- a failure that cannot be classified: as the machine's, unless the attempt before
  ended with the same one (`failures.signature`): then the job stops, saying so.

`judge` runs before the job's group closes (a survivor must find the note when its
collective fails) and returns what to do after the close.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disttrain import worker_notes
from disttrain.errors import UserError
from disttrain.runtime import failures

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Ending:
    """After the group is closed: wait for the launcher to stop the job (after a note
    it acts on), then exit with `status`."""

    status: int
    wait: bool = False
    then: Callable[[], Ending] | None = None
    """What decides the ending once the job is closed: a retried failure's line waits a
    moment for a peer's note (`settled`), and the job's trackers must be closed first,
    before torchrun's agent stops this rank."""

    def settled(self) -> Ending:
        return self.then() if self.then is not None else self


@dataclass(frozen=True)
class FailurePoint:
    """What `judge` knows of the job that failed: who speaks, where it failed, and the
    two facts it asks only when the verdict needs them."""

    name: str
    """How the job speaks: 'job' (a script's `dt.Job`) or 'train' (`disttrain train`)."""
    rank: int
    step: int
    """The step the failure belongs to (0: before the first step)."""
    in_memory_recovery: bool
    """Under fast recovery: a lost peer is recovered in memory, not restarted."""
    oom_facts: Callable[[], dict | None] = lambda: None
    """The planner's facts for an out-of-memory line (`oom_facts`)."""
    peer_gone: Callable[[], bool] = lambda: False


def oom_facts(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, strategy: str, world: int, precision: str
) -> dict | None:
    """What the launcher's planner needs for an out-of-memory line: the parameters'
    shapes, the strategy, the world size, the optimizer's kind and the precision."""
    if model is None:
        return None
    shapes = [list(p.shape) for p in model.parameters()]
    name = type(optimizer).__name__.lower() if optimizer is not None else "adamw"
    if optimizer is not None and name.startswith("sgd"):
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        name = "sgd-momentum" if momentum else "sgd"
    return {
        "params": sum(math.prod(s) for s in shapes),
        "shapes": shapes,
        "strategy": strategy,
        "world": world,
        "optimizer": name,
        "precision": precision,
    }


def judge(exc: BaseException, where: FailurePoint) -> Ending | None:
    """The ending for `exc` under `disttrain run` (see the module); None: propagate."""
    if not worker_notes.under_launcher():
        return None
    if not isinstance(exc, Exception) and not failures.is_program_exit(exc):
        return None  # a preemption's exit, a stop from outside: not a failure
    if isinstance(exc, UserError):
        worker_notes.write_user_error(where.name, exc)
        return Ending(2, wait=True)
    if worker_notes.earlier_stop():  # first: a peer that stopped the job may have taken the store
        return Ending(0)
    rank, step = where.rank, where.step
    verdict = failures.classify(exc, peer_gone=where.peer_gone())
    if verdict.kind == failures.PROGRAM:
        failures.report_program_error(exc, rank, step, oom=where.oom_facts() if verdict.oom else None)
        return Ending(failures.exit_status(exc), wait=True)
    if where.in_memory_recovery:
        return None  # fast recovery recovers in memory
    return Ending(1, then=lambda: lost_peer_ending(rank, step, verdict, exc))


def refuse_at_start(name: str, error: UserError) -> None:
    """A mistake found while a `dt.Job` is built, before its `with` block (so `judge`
    never sees it): under `disttrain run` one line from the launcher, which stops the
    job (exit 2, not retried); elsewhere `error` propagates."""
    if not worker_notes.under_launcher():
        raise error
    worker_notes.write_user_error(name, error)
    worker_notes.wait_to_be_stopped()
    raise failures.JudgedExit(2) from None


def lost_peer_ending(rank: int, step: int, verdict: failures.Verdict, exc: BaseException) -> Ending:
    """The restart path's end of a rank whose collective failed, decided after the job
    closed: a peer that crashed, or ended its code, leaves its note a moment after the
    connection closed (`worker_notes.PEER_NOTE_WAIT_S`), one of another node has put
    its note on the rendezvous' store first (`elastic.note_relay`); without one, a lost
    peer."""
    from disttrain.elastic import note_relay

    if note_relay.adopt_in_worker() or worker_notes.earlier_stop(worker_notes.PEER_NOTE_WAIT_S):
        return Ending(0)
    if failures.report_early_finish(rank, step, verdict):
        return Ending(1, wait=True)
    return machine_ending(rank, step, verdict, exc)


def machine_ending(rank: int, step: int, verdict: failures.Verdict, exc: BaseException) -> Ending:
    """The restart path's end of a rank that lost a peer (or failed unclassified)."""
    where = failures.trace_to_log(rank, exc)
    if verdict.kind == failures.UNKNOWN and failures.crash_loop(verdict, step):
        return Ending(1, wait=True)
    restart, _ = failures.attempt()
    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart
    then = (
        f"torchrun restarts the job from its newest checkpoint ({left} restart(s) left)"
        if left > 0
        else "no restart left: the job stops"
    )
    at = f"at step {step}" if step else "before the first step"
    if verdict.kind == failures.MACHINE:
        worker_notes.note_lost_peer(rank)
    failures.say_once(f"disttrain run: rank {rank} {verdict.what} {at} ({verdict.cause}); {then}; {where}")
    sys.stderr.flush()
    return Ending(1)
