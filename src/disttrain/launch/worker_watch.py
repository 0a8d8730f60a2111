"""The process torchrun watches for one worker (a stub): it passes the worker the signals
torchrun sends, waits for its end, and says what that end was.

Two ways in, one watch: a warm server's stub (`launch.warm_workers.run_stub`) gets its
worker's wait status from the server; a worker the launcher started directly forks the
worker and waits for it itself (`launch.worker_entry.watched_by_parent`). Either way:
- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to the stub reach the worker;
- a death by a signal nobody sent through the stub that is the program's (a native
  crash, an abort: `runtime.failures.classify_death`) hands the launcher the note that
  stops the job without a restart, with the Python stack faulthandler wrote;
- a worker ended at the exit bound after its code had finished (`runtime.exit_bound`)
  is one line, and the stub exits with its code's status;
- any other end that is not a success (a kill from outside, an exit status with no
  exception reported) goes to the crash-loop breaker: the same end at the same step
  in two attempts in a row stops the job;
- otherwise the stub exits with the worker's status, or dies of its signal, so torchrun
  reports what it would have without the stub.
Plain Python: the stub imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from disttrain.runtime import processes

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def watch(pid: int, wait_status: Callable[[], int | None]) -> int:
    """Be the process torchrun watches for worker `pid` (a stub): pass it the signals of
    `FORWARDED`, wait for its wait status (`wait_status`; None: lost, exit 1), judge a
    death by a signal nobody sent through here (`_judge_death`) and a stuck exit
    (`_stuck_exit`); return its exit status, or die of its signal."""
    processes.name_worker("stub")
    forwarded: list[int] = []
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum, forwarded))
    status = wait_status()
    if status is None:
        return 1
    code = os.waitstatus_to_exitcode(status)
    if code < 0 and not forwarded:
        _judge_death(code)
    if code == 1:
        code = _stuck_exit(pid, code)
    if code != 0 and not forwarded:
        _break_loop(code)
    if code < 0:  # die of the child's signal, so torchrun reports it as its own
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _stuck_exit(pid: int, code: int) -> int:
    """The worker ended with status 1: when that was the exit bound ending a rank whose
    code had finished (`runtime.exit_bound`), say so in one line and return the status
    its code ended with; else `code`."""
    from disttrain.runtime import exit_bound

    stuck = exit_bound.stuck_exit(pid)
    if stuck is None:
        return code
    status, log = stuck
    line = (
        f"disttrain run: rank {os.environ.get('RANK', '?')} finished its code but had not exited "
        f"{exit_bound.bound_s():g} s later (a thread that never ends, or a destructor waiting on one); "
        f"it was ended, and its stack at that moment is in {log}. {exit_bound.BOUND_ENV} sets the bound.\n"
    )
    # One write: several ranks' stubs say this at once, and an unbuffered print is two writes.
    os.write(sys.stderr.fileno(), line.encode())
    return status


def _judge_death(code: int) -> None:
    """The worker died of signal -`code` that nobody sent it through this stub: when it
    is the program's (a native crash, an abort, SIGINT: `failures.classify_death`), hand
    the launcher the note that stops the job without a restart, then wait to be stopped
    (a SIGTERM now ends the stub at once)."""
    from disttrain import worker_notes
    from disttrain.launch import stop_sharing
    from disttrain.runtime import failures

    stop_sharing.share_if_fast()  # under fast recovery the other nodes must stop too
    if failures.report_crash(int(os.environ.get("RANK", "0")), code):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        worker_notes.wait_to_be_stopped()


def _break_loop(code: int) -> None:
    """The worker ended with `code` (a status, or minus a signal) that no one passed on
    through this stub: the crash-loop breaker's turn (`failures.repeated_death`): the
    same end at the same step as the attempt before stops the job; then wait to be
    stopped."""
    from disttrain import worker_notes
    from disttrain.launch import stop_sharing
    from disttrain.runtime import failures

    stop_sharing.share_if_fast()  # under fast recovery the other nodes must stop too
    if failures.repeated_death(int(os.environ.get("RANK", "0")), code):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        worker_notes.wait_to_be_stopped()


def _forward(pid: int, signum: int, forwarded: list[int]) -> None:
    forwarded.append(signum)
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
