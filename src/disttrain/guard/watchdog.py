"""Hang watchdog: a stalled step becomes one summary and a fast exit (P-DEBUG-1).

Each rank runs one daemon thread. The training thread only updates a few attributes
(`step()` at each step boundary, `phase(name)` around the parts worth naming), so the
cost per step is a few microseconds. Every `tick_s` the thread writes this rank's
heartbeat (step, phase, recent phase history, pid, host) to a side channel that does
not depend on the process group: files in a directory (by default a private per-job
folder on this host, `private_dir.default_dir`; point `dir` at a shared file system
for several nodes). Only this user's folders are used, files are never opened through
a symlink, a `stall` file older than this process is stale, and only processes whose
pid and start time match their heartbeat are ever signalled.

A rank fires when its own step has run longer than the bound, or a peer's heartbeat
stops (a stopped or dead process). The bound is `hang_factor` x the median step time,
at least `hang_min_s`, at most `hang_cap_s` (the cap alone until `warmup_steps` steps
were timed). Work that is not a step (a checkpoint save or load, an evaluation) runs
in a slow phase, `slow_phase(name, nbytes)`: it has its own bound, a floor plus
`nbytes` at a conservative disk speed, and its time does not count toward the step.
The first rank to fire (an exclusive file create) collects every heartbeat, dumps each
local rank's Python stack (py-spy when installed, else faulthandler via SIGUSR1), prints
ONE summary that says where each rank is and which rank lags, writes the full report
next to the heartbeats, and exits with `HANG_EXIT_CODE` so torchrun tears the job down,
long before the collective timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from disttrain import worker_notes
from disttrain.guard import private_dir, side_channel
from disttrain.guard.hang_report import diagnose, format_summary
from disttrain.guard.stacks import dump_stacks, proc_state
from disttrain.runtime.log import EVERY_RANK, LOGGER

HANG_EXIT_CODE = 124
"""Exit status of a rank that reported a hang (the `timeout` command's convention)."""
SLOW_MIN_S = 300.0
"""Floor of a slow phase's bound, in seconds (never below `hang_cap_s`)."""
SLOW_BYTES_PER_S = 50e6
"""Disk speed assumed for a slow phase's bytes: slow for local NVMe, plausible for a
busy network file system, so a large save or load is not called a hang."""


def job_key() -> str:
    """Names one attempt of one job: torchrun's run id, port and restart count (the
    subfolder of a shared `guard.dir`; `private_dir.attempt_name` names the default).

    The restart count matters: an elastic restart keeps the run id, and a stale
    'stall' file from the failed attempt must not stop the new one.
    """
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    port = os.environ.get("MASTER_PORT", str(os.getppid()))
    return f"{job}-{port}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def default_dir() -> Path:
    """A private directory unique to this attempt of this job on this host (see
    `private_dir.default_dir`; raises `UnsafeGuardDir` when its parent is not private)."""
    return private_dir.default_dir()


FOLLOW_S = 30.0
"""How long a rank that did not report a hang waits for the reporter's report."""

_FIRST_START: dict[int, float] = {}
"""pid -> when that process first started a watchdog (per pid: a forked worker is a new
process): a `stall` written before it is stale (from an earlier job that used the same
folder), however the folder was named."""


class Watchdog:
    """Per-rank hang detector. `start()` it after `init()`, `stop()` it on every exit path.

    `step(n)` marks a step boundary (and times the step); `with wd.phase("name"):`
    names what the rank is doing; `with wd.slow_phase("name", nbytes):` marks work
    that is not a step. On a hang the process exits with `HANG_EXIT_CODE`
    after printing the summary; nothing is raised in the training thread, which is
    blocked in C++ and cannot be interrupted.
    """

    def __init__(
        self,
        *,
        dir: str | os.PathLike | None = None,
        hang_factor: float = 20.0,
        hang_min_s: float = 60.0,
        hang_cap_s: float = 600.0,
        tick_s: float = 1.0,
        warmup_steps: int = 3,
        exit_code: int = HANG_EXIT_CODE,
        slow_min_s: float = SLOW_MIN_S,
        slow_bytes_per_s: float = SLOW_BYTES_PER_S,
    ):
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self._chosen = dir is not None
        self.dir = Path(dir) if dir else Path()  # the default is found (and checked) by start()
        self.hang_factor, self.hang_min_s, self.hang_cap_s = hang_factor, hang_min_s, hang_cap_s
        self.tick_s, self.warmup_steps, self.exit_code = tick_s, warmup_steps, exit_code
        self.slow_min_s, self.slow_bytes_per_s = slow_min_s, slow_bytes_per_s
        self.step_no = 0
        self.phase_name = "start"
        self.step_since = self.phase_since = time.monotonic()
        self.durations: deque[float] = deque(maxlen=101)
        # A resumed attempt starts with the pace of the attempt before (`_note_pace`), not
        # with the cap: its hang is found as soon as the first attempt's was.
        earlier = worker_notes.read_pace(self.rank)
        if earlier is not None:
            self.durations.extend([earlier] * warmup_steps)
        self.history: dict[str, deque[int]] = {}
        """phase -> the steps of its last entries (to name the step a rank skipped)."""
        self.counts: dict[str, int] = {}
        """phase -> entries since start (a skip older than the history still shows)."""
        self.slow = 0
        """Depth of slow phases; inside, `slow_deadline` bounds the work instead of the step bound."""
        self.slow_since = 0.0
        self.slow_deadline: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file: TextIO | None = None
        self._usr1 = False
        self.host = socket.gethostname()

    # ------------------------------------------------------------ training thread

    def step(self, n: int | None = None) -> None:
        """Mark a step boundary: the step that ends is timed, the next one starts now."""
        now = time.monotonic()
        self.durations.append(now - self.step_since)
        self.step_since = self.phase_since = now
        self.step_no = self.step_no + 1 if n is None else n
        self.phase_name = "step"

    def phase(self, name: str, slow: bool = False) -> _Phase:
        """`with wd.phase("backward"):` — where this rank is, for the summary.

        Every rank must enter the same phases at the same steps (a phase that only some
        ranks enter reads as a skipped collective). `slow=True` is
        `slow_phase(name)` with no bytes: bounded by `hang_cap_s` (or the slow floor).
        """
        return _Phase(self, name, self.slow_bound(0) if slow else None)

    def slow_phase(self, name: str, nbytes: int = 0) -> _Phase:
        """`with wd.slow_phase("checkpoint.save", nbytes=n):` — work that is not a step
        and may take much longer (a save or load of `nbytes`, an evaluation). It is a
        hang only past `slow_bound(nbytes)`, and its time is not counted in the step
        (neither in the step's bound nor in the median step time)."""
        return _Phase(self, name, self.slow_bound(nbytes))

    def slow_bound(self, nbytes: int = 0) -> float:
        """Seconds a slow phase over `nbytes` may run: the larger of `hang_cap_s` and
        `slow_min_s`, plus the bytes at `slow_bytes_per_s`."""
        return max(self.hang_cap_s, self.slow_min_s) + max(0, nbytes) / self.slow_bytes_per_s

    def bound(self) -> float:
        """Seconds the current step (or slow phase) may run before it counts as a hang."""
        deadline = self.slow_deadline
        if deadline is not None:
            return deadline - self.slow_since
        if len(self.durations) < self.warmup_steps:
            return self.hang_cap_s
        typical = statistics.median(self.durations)
        return min(self.hang_cap_s, max(self.hang_min_s, self.hang_factor * typical))

    # ------------------------------------------------------------ lifetime

    def start(self) -> Watchdog:
        """Join the side channel (made 0700 if needed, safe against a peer's removal: see
        `side_channel`), arm faulthandler, start the thread. A folder given as `dir`
        that another user owns or can write raises `UnsafeGuardDir`; when the default
        one is such, the watchdog stays off with a warning (training goes on)."""
        _FIRST_START.setdefault(os.getpid(), time.time())
        try:
            if not self._chosen:
                self.dir = default_dir()
            # Fallback stack dump for when py-spy is absent: the reporter sends SIGUSR1.
            self._stack_file = side_channel.join(self.dir, self._first_files)
        except private_dir.UnsafeGuardDir as e:
            if self._chosen:
                raise
            LOGGER.warning(f"disttrain guard: hang watchdog off on rank {self.rank}: {e}", extra=EVERY_RANK)
            return self
        # Only when nobody else handles SIGUSR1: a user's handler is never replaced.
        if (
            hasattr(signal, "SIGUSR1")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
        ):
            faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True, chain=False)
            self._usr1 = True
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def _first_files(self) -> TextIO:
        """This rank's stack file and its first "running" heartbeat, which keeps a
        peer's `_cleanup` from removing the folder from now on."""
        stack_file = os.fdopen(private_dir.create(self.dir / f"stack{self.rank}.txt"), "w")
        self._beat()
        return stack_file

    def stop(self) -> None:
        """Stop the thread and publish a final 'exited' heartbeat. Safe to call twice."""
        if self.halt():
            self._beat(state="exited")
            self._cleanup()

    def halt(self) -> bool:
        """Stop the thread and release SIGUSR1, leaving the heartbeat file as it is (a
        successor watchdog of this rank takes it over). True when it was running."""
        self._stop.set()
        running = self._thread is not None
        if self._thread is not None:
            self._thread.join(timeout=5 * self.tick_s)
            self._thread = None
        if self._stack_file is not None:
            if self._usr1:
                faulthandler.unregister(signal.SIGUSR1)
                self._usr1 = False
            self._stack_file.close()
            self._stack_file = None
        return running

    def _cleanup(self) -> None:
        """The last rank to stop removes the side channel, unless it holds a hang report."""
        side_channel.leave(self.dir, self._all_exited)

    def _all_exited(self) -> bool:
        if self._stall() is not None:
            return False
        beats = self._read_beats()
        return bool(beats) and all(b["state"] == "exited" for b in beats) and len(beats) >= self.local_world()

    def local_world(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ watchdog thread

    def heartbeat(self, state: str = "running") -> dict:
        now = time.monotonic()
        try:
            history = {k: list(v) for k, v in list(self.history.items())}
            counts = dict(self.counts)
        except RuntimeError:  # the training thread added a phase meanwhile; next tick
            history, counts = {}, {}
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "start": _own_start(),
            "host": self.host,
            "step": self.step_no,
            "phase": self.phase_name,
            "step_elapsed": now - self.step_since,
            "phase_elapsed": now - self.phase_since,
            "alive": time.time(),
            "state": state,
            "history": history,
            "counts": counts,
            "bound": self.bound(),
        }

    def _beat(self, state: str = "running") -> None:
        path = self.dir / f"hb{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        try:
            private_dir.write(tmp, json.dumps(self.heartbeat(state)).encode())
            os.replace(tmp, path)  # readers never see half a heartbeat
        except OSError:
            pass  # a full or vanished disk must not kill training; the next tick retries

    def _note_pace(self) -> None:
        """Keep this rank's typical step time for a later attempt of the launch."""
        if len(self.durations) >= self.warmup_steps:
            worker_notes.note_pace(self.rank, statistics.median(self.durations))

    def _stall(self) -> dict | None:
        """The `stall` record of this job's hang, or None: no file, not yet written in
        full, or stale (`_stale`)."""
        try:
            record = json.loads(private_dir.read(self.dir / "stall"))
        except (OSError, ValueError):
            return None
        return None if _stale(record) else record

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.tick_s):
            try:
                self._beat()
                self._note_pace()
                if self._stall() is not None:
                    self._follow()
                    return
                reason = self._check()
            except Exception as e:  # e.g. a foreign file in the directory; keep watching
                if not warned:
                    LOGGER.warning(
                        f"disttrain guard: watchdog on rank {self.rank}: {type(e).__name__}: {e}", extra=EVERY_RANK
                    )
                    warned = True
                continue
            if reason:
                self._fire(reason)
                return

    def _read_beats(self) -> list[dict]:
        beats = []
        for path in sorted(self.dir.glob("hb*.json")):
            try:
                beats.append(json.loads(private_dir.read(path)))
            except (OSError, ValueError):
                continue
        return sorted(beats, key=lambda b: b["rank"])

    def _check(self) -> str | None:
        bound, deadline = self.bound(), self.slow_deadline
        if deadline is not None:
            elapsed = time.monotonic() - self.slow_since
            if elapsed > bound:
                return (
                    f"slow phase '{self.phase_name}' in step {self.step_no} on rank {self.rank} "
                    f"has run {elapsed:.1f} s, over its bound of {bound:.1f} s"
                )
        elif (elapsed := time.monotonic() - self.step_since) > bound:
            return f"step {self.step_no} on rank {self.rank} has run {elapsed:.1f} s, over the bound of {bound:.1f} s"
        return self._silent_peer(bound)

    def _silent_peer(self, bound: float) -> str | None:
        """Why to fire when a running peer's heartbeat stopped for longer than `bound`."""
        now = time.time()
        for b in self._read_beats():
            silent = now - b["alive"]
            if b["rank"] != self.rank and b["state"] == "running" and silent > max(bound, 5 * self.tick_s):
                return f"rank {b['rank']} sent no heartbeat for {silent:.1f} s (bound {bound:.1f} s)"
        return None

    def _follow(self) -> None:
        """Another rank reports; give it time to dump our stack, then leave."""
        if self._stack_file is not None:
            faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
        # Leave once the reporter has read the stacks (its report is written after them),
        # so the job ends seconds after a hang; 30 s at most when the reporter died.
        deadline = time.monotonic() + FOLLOW_S
        while not (self.dir / private_dir.REPORT_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(self.exit_code)

    def _fire(self, reason: str) -> None:
        record = json.dumps({"rank": self.rank, "reason": reason, "time": time.time()}).encode()
        stall = self.dir / "stall"
        try:
            fd = self._elect(stall)
        except FileExistsError:
            self._follow()
            return
        except OSError:
            fd = None  # no election possible (the directory vanished): report anyway
        if fd is not None:
            os.write(fd, record)
            os.close(fd)
        try:
            self._report(reason)
        except Exception as e:  # a bug in the report must never turn back into a hang
            LOGGER.error(
                f"disttrain guard: HANG detected by rank {self.rank}: {reason}. (The full "
                f"report failed: {type(e).__name__}: {e}.)",
                extra=EVERY_RANK,
            )
        os._exit(self.exit_code)

    def _elect(self, stall: Path) -> int:
        """The `stall` file created by this rank (O_EXCL: the first rank to fire wins).
        A stale one (see `_stall`) is replaced; a current one raises FileExistsError."""
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)
        try:
            return os.open(stall, flags, 0o600)
        except FileExistsError:
            try:
                record = json.loads(private_dir.read(stall))
            except ValueError:
                raise FileExistsError(stall) from None  # a peer's, still being written
            except OSError:
                record = None  # gone since, or not a plain file: replace it
            if record is not None and not _stale(record):
                raise
        try:
            os.unlink(stall)  # stale, or a peer's still empty: the O_EXCL below decides again
        except FileNotFoundError:
            pass
        return os.open(stall, flags, 0o600)

    def _report(self, reason: str) -> None:
        beats = self._read_beats()
        now = time.time()  # before the dumps: their duration must not age the heartbeats
        # Signalled (SIGUSR1, SIGCONT) and read by py-spy: only this host's processes
        # that are still the ones their heartbeat names (this user's, same start time).
        local = [b for b in beats if b["host"] == self.host and _same_process(b)]
        for b in local:
            b["proc_state"] = proc_state(b["pid"])
        stacks = dump_stacks(local, self.dir)
        verdict, lagging = diagnose(beats, now, stale_after=max(self.bound(), 5 * self.tick_s), stacks=stacks)
        report = self.dir / private_dir.REPORT_NAME
        summary = format_summary(
            reason=reason,
            reporter=self.rank,
            world=self.world,
            beats=beats,
            verdict=verdict,
            lagging=lagging,
            stacks=stacks,
            report=report,
        )
        full = summary + "\n\n" + "\n\n".join(f"--- rank {r} stack ---\n{text}" for r, text in sorted(stacks.items()))
        try:
            private_dir.write(report, full.encode())
        except OSError:
            pass
        LOGGER.error(summary, extra=EVERY_RANK)
        from disttrain.runtime.failures import report_hang

        report_hang(self.rank, lagging, self.step_no)
        for b in local:  # let stopped peers receive the launcher's SIGTERM
            if b.get("proc_state") == "T":
                try:
                    os.kill(b["pid"], signal.SIGCONT)
                except OSError:
                    pass


_OWN_START: dict[int, int | None] = {}
"""pid -> its start time: per pid, as a warm worker is forked after this import."""


def _own_start() -> int | None:
    """This process's start time, in its heartbeat: with the pid, what a reporter checks
    before it signals the process (a pid alone may have been reused)."""
    pid = os.getpid()
    if pid not in _OWN_START:
        _OWN_START[pid] = private_dir.this_process_start()
    return _OWN_START[pid]


def _stale(record) -> bool:
    """A `stall` record written before this process first started a watchdog: an
    earlier job's, in a folder that job used too (same guard.dir and job key)."""
    written = record.get("time") if isinstance(record, dict) else None
    # 1 s: the clocks of hosts that share a guard.dir drift a little
    first = _FIRST_START.get(os.getpid())
    return not isinstance(written, (int, float)) or first is None or written < first - 1.0


def _same_process(beat: dict) -> bool:
    """True when the heartbeat's pid is still the process that wrote it: this user's,
    started when the heartbeat says."""
    pid, start = beat.get("pid"), beat.get("start")
    return isinstance(pid, int) and start is not None and private_dir.process_start(pid) == start


class _Phase:
    """A class, not a generator context manager: it runs on every step, so it is cheap."""

    __slots__ = ("wd", "name", "prev", "allow")

    def __init__(self, wd: Watchdog, name: str, allow: float | None = None):
        self.wd, self.name, self.allow = wd, name, allow  # allow: a slow phase's bound

    def __enter__(self) -> None:
        wd, now = self.wd, time.monotonic()
        if self.allow is not None:  # deadline last: the thread reads it as "slow from here"
            if not wd.slow:
                wd.slow_since = now
            wd.slow += 1
            wd.slow_deadline = max(wd.slow_deadline or 0.0, now + self.allow)
        self.prev = wd.phase_name
        wd.phase_name, wd.phase_since = self.name, now
        steps = wd.history.get(self.name)
        if steps is None:
            steps = wd.history[self.name] = deque(maxlen=64)
        steps.append(wd.step_no)
        wd.counts[self.name] = wd.counts.get(self.name, 0) + 1

    def __exit__(self, *exc) -> None:
        wd = self.wd
        wd.phase_name = self.prev
        if self.allow is not None:
            wd.slow -= 1
            if not wd.slow:  # the step resumes with the slow time taken out; deadline last
                wd.step_since += time.monotonic() - max(wd.slow_since, wd.step_since)
                wd.slow_deadline = None
