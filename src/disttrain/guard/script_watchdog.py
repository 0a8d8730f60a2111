"""The hang watchdog of a plain script under `disttrain run` (P-DEBUG-1).

A script that does not use `dt.Job` marks no steps, so `Watchdog`'s bound (a multiple
of the median step time) has nothing to measure. This one watches the main thread
instead: every tick it reads the main thread's innermost Python frame and the number of
collectives the rank has issued. A rank whose main thread waits in a collective (a
torch.distributed call, DDP's forward, a backward under DDP) while that number stands
still for longer than the bound fires, and `Watchdog`'s report follows: every local
rank's stack, and the rank whose main thread is not in a collective named as the one
that stopped making progress, with the line it is at. A frozen or dead peer is found
by its heartbeat, as under Job. Before the process group is up, and on a release
whose group cannot count its collectives, only the heartbeats are watched.

`disttrain run` starts one in every worker of a multi-process script
(`launch/worker_entry.py`); the bound is `--hang-timeout S` (DISTTRAIN_HANG_TIMEOUT_S),
600 s by default (NCCL's own collective timeout, so the report comes before torch's
error), 0 for none. A script that starts `dt.Job` hands over to Job's watchdog, which
knows the steps (`hand_over`, called by `guard.run_guard.start_guard`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

from disttrain.guard.hang_report import in_collective
from disttrain.guard.watchdog import Watchdog
from disttrain.runtime import processes

HANG_TIMEOUT_ENV = "DISTTRAIN_HANG_TIMEOUT_S"
"""Seconds a plain script's rank may wait in one collective with no progress; 0: off."""
DEFAULT_HANG_TIMEOUT_S = 600.0
OWN_CODE, WAITING = "its own code", "waiting in a collective"
"""The two phases a plain script's heartbeat shows."""


def innermost_frames(ident: int | None) -> list[str]:
    """The thread's innermost frame as 'function (file:line)' (py-spy's form), in a list
    (empty for a thread that is gone): all that `in_collective` judges."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return [] if frame is None else [f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"]


def collectives_issued() -> int | None:
    """The rank's collective count once its process group is up (None before).

    torch is imported by the script itself; the watchdog thread only reads it once
    `torch.distributed` is in sys.modules, so it never races the script's import."""
    if "torch.distributed" not in sys.modules:
        return None
    from disttrain.runtime.torch_compat import collectives_issued as issued

    return issued()


class ScriptWatchdog(Watchdog):
    """`Watchdog` whose progress is the main thread's collectives, not marked steps.

    The training thread calls nothing: everything is read by the watchdog's thread.
    """

    def __init__(self, bound_s: float, **kw):
        super().__init__(hang_min_s=bound_s, hang_cap_s=bound_s, **kw)
        self._main = threading.main_thread().ident
        self._wait: tuple[int, float] | None = None
        """(collectives issued, since when) while the main thread waits in a collective."""
        self.phase_name = OWN_CODE

    def _check(self) -> str | None:
        frames = innermost_frames(self._main)
        now, bound = time.monotonic(), self.hang_cap_s
        # No count before the group is up: a wait in the rendezvous is torch's to time out
        # (a peer still importing is not a hang).
        count = collectives_issued() if in_collective(frames) else None
        if count is None:
            if self.phase_name != OWN_CODE:
                self.phase_name, self.phase_since = OWN_CODE, now
            self._wait = None
            return self._silent_peer(bound)
        if self._wait is None or self._wait[0] != count:
            self._wait = (count, now)
            self.phase_name, self.phase_since = WAITING, now
        elif now - self._wait[1] > bound:
            return (
                f"rank {self.rank}'s main thread has waited {now - self._wait[1]:.0f} s in a "
                f"collective with no progress (at {frames[0]}), over the bound of {bound:g} s "
                f"(disttrain run --hang-timeout)"
            )
        return self._silent_peer(bound)


def hang_timeout_s(env: dict | None = None) -> float:
    """The bound from DISTTRAIN_HANG_TIMEOUT_S (a number of seconds >= 0), else the default.
    Raises ValueError naming the variable for anything else."""
    raw = (os.environ if env is None else env).get(HANG_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_HANG_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{HANG_TIMEOUT_ENV} (--hang-timeout) is {raw!r}; give the seconds a rank may "
            f"wait in one collective, e.g. 600, or 0 for no hang watchdog."
        )
    return value


HANG_FLAG = "--hang-timeout"
"""`disttrain run`'s flag for the bound (seconds; 0: no script watchdog)."""


def take_hang_timeout(flags: list[str], value: str | None) -> tuple[list[str], dict[str, str]]:
    """`flags` without `--hang-timeout V` / `--hang-timeout=V` (its `value`), and the env
    that carries it to the workers. A bad value is a `UserError` in the launching
    process, before any worker starts."""
    from disttrain.errors import UserError

    if value is None:
        return flags, {}
    try:
        hang_timeout_s({HANG_TIMEOUT_ENV: value})
    except ValueError as e:
        raise UserError(str(e)) from None
    at = [i for i, f in enumerate(flags) if f == HANG_FLAG]
    drop = {*at, *(i + 1 for i in at), *(i for i, f in enumerate(flags) if f.startswith(HANG_FLAG + "="))}
    return [f for i, f in enumerate(flags) if i not in drop], {HANG_TIMEOUT_ENV: value}


def start_for_script() -> ScriptWatchdog | None:
    """Start this worker's script watchdog when it runs with others and a bound is set."""
    bound = hang_timeout_s()
    if bound <= 0 or int(os.environ.get("WORLD_SIZE", "1")) < 2 or processes.STATE.watchdog is not None:
        return None
    running = processes.STATE.watchdog = ScriptWatchdog(bound)
    running.start()
    atexit.register(running.stop)
    return running


def hand_over(successor_dir: Path | None) -> None:
    """Stop this process's script watchdog for one that knows the steps (Job's), or for
    none (`successor_dir` None: the guard is off). In the same side channel its
    heartbeat file stays: the successor writes the same file."""
    running = processes.STATE.watchdog
    if running is not None:
        if successor_dir is not None and running.dir == successor_dir:
            running.halt()
        else:
            running.stop()
        processes.STATE.watchdog = None
