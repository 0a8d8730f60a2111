"""Whose failure is it: the machine's or the program's. One classifier for both recovery
paths: the in-memory one (`elastic.fast_recovery`) and torchrun's restart (`disttrain
run --max-restarts N`, decided in `dt.Job`'s exit, `train.job_failure`, or for a plain
script in `launch.worker_entry`); docs/elastic.md "What is retried and what is not".

The contract:

| what ended the attempt | whose | what happens |
|---|---|---|
| a peer process died (its supervisor or the launcher knows it) | machine | retried |
| a collective's transport error: gloo's closed or reset pair, an NCCL error | machine | retried |
| a collective timeout while a peer is gone | machine | retried |
| SIGKILL from outside (the OOM killer included) | machine | retried |
| a loader worker killed by SIGKILL ("DataLoader worker ... is killed by signal: Killed") | machine | retried |
| a crash signal the process raised itself (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT: a native crash, gloo or NCCL aborting a rank for a mismatched collective) | program | stopped, with the Python stack at the crash |
| SIGINT or `KeyboardInterrupt` the program raised, or `sys.exit(n)` with n > 0, in a plain script | program | stopped |
| any other exception, the user's code or ours, on the rank that raised it | program | stopped, not retried |
| `torch.OutOfMemoryError`, `MemoryError` | program | stopped, with the planner's estimate and the fixes |
| a collective timeout with every peer alive (a RuntimeError or TimeoutError saying it timed out) | unknown | retried, until the same failure ends two attempts in a row |

A transport error is recognised by its type (torch's `DistError` family: backend,
network and store errors) or by the words gloo and NCCL put in the `RuntimeError` they
raise (`TRANSPORT_WORDS`); the user's own `ConnectionError` (a tracker, a data service)
is the program's. A survivor's transport error caused by a peer that raised a
program's error is not retried either: that peer's note ends the job
(`report_program_error`, through `worker_notes`).

`signature` is what the crash-loop breaker (`crash_loop`) compares between two
attempts: the type, the message with addresses, ports, pointers and durations masked,
and the step (0: before the first step). `say_once` is the one line per failure of an
attempt, `trace_to_log` the rank's full traceback. Plain Python: no torch import
(types are matched by name), so the launcher and the slot supervisor can use it.
"""  # noqa: E501  (the table's rows: a Markdown row cannot wrap)

from __future__ import annotations

import os
import re
import signal
import traceback
from dataclasses import dataclass

from disttrain import worker_notes
from disttrain.runtime import fault_injection
from disttrain.runtime.log import EVERY_RANK, LOGGER
from disttrain.runtime.process_state import STATE

MACHINE, PROGRAM, UNKNOWN = "machine", "program", "unknown"

TRANSPORT_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
"""torch.distributed's error classes for a collective's backend, its network and its store."""
CLOSED_WORDS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error", "Broken pipe")
"""gloo's words for a connection a peer closed (never a slow peer)."""
NCCL_WORDS = ("NCCL error", "ncclRemoteError", "ncclSystemError", "NCCL communicator was aborted", "ProcessGroupNCCL")
TRANSPORT_WORDS = ("gloo/transport", *CLOSED_WORDS, *NCCL_WORDS)
"""Words of the RuntimeError gloo and NCCL raise when a peer's connection fails (checked
on torch 2.13: gloo raises a plain RuntimeError naming pair.cc)."""
TIMEOUT_WORDS = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
OOM_TYPES = ("OutOfMemoryError", "MemoryError")
LOADER_KILLED = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) is killed by signal: Killed")
"""torch's words when a loader worker died of SIGKILL: from outside (the OOM killer). A
worker that crashed by itself is "killed by signal: Segmentation fault" and the like."""
LOADER_VANISHED = "exited unexpectedly"
"""torch's words for a loader worker gone without a signal it could name: cannot tell."""


@dataclass(frozen=True)
class Verdict:
    """`kind`: MACHINE, PROGRAM or UNKNOWN; `error`: the exception's type name (or the
    signal's); `message`: its first line; `oom`: an out-of-memory error."""

    kind: str
    error: str
    message: str
    oom: bool = False

    @property
    def retried(self) -> bool:
        return self.kind != PROGRAM

    @property
    def what(self) -> str:
        """How a retried failure reads in its one line: a lost peer or loader worker, or
        one of unknown kind."""
        if self.kind != MACHINE:
            return "failed (cannot tell whose failure)"
        return "lost a loader worker to a kill from outside" if LOADER_KILLED.search(self.message) else "lost a peer"

    @property
    def cause(self) -> str:
        """A few words for a one-line report: a closed connection's or NCCL's words (their
        messages are long and name addresses), else the message as raised (its start)."""
        words = [w for w in (*CLOSED_WORDS, *NCCL_WORDS) if w in self.message]
        return f"{self.error}: {words[0] if words else self.message[:160]}"


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def is_transport_error(exc: BaseException) -> bool:
    """A collective's (or its store's) transport failed: a peer's connection closed,
    reset or timed out underneath it."""
    if _names(exc) & set(TRANSPORT_TYPES):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in TRANSPORT_WORDS)


def is_collective_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, TimeoutError)) and any(w in str(exc) for w in TIMEOUT_WORDS)


def classify(exc: BaseException, *, peer_gone: bool = False) -> Verdict:
    """The verdict on `exc`, raised on this rank. `peer_gone`: whether this process knows
    that a peer of its group has died (a generation bumped by a promoted spare)."""
    name, message = type(exc).__name__, first_line(exc)
    if _names(exc) & set(OOM_TYPES):
        return Verdict(PROGRAM, name, message, oom=True)
    if is_collective_timeout(exc) and not any(w in str(exc) for w in CLOSED_WORDS):
        return Verdict(MACHINE if peer_gone else UNKNOWN, name, message)
    if is_transport_error(exc) or (isinstance(exc, RuntimeError) and LOADER_KILLED.search(message)):
        return Verdict(MACHINE, name, message)
    if isinstance(exc, RuntimeError) and "DataLoader worker" in message and LOADER_VANISHED in message:
        return Verdict(UNKNOWN, name, message)
    return Verdict(PROGRAM, name, message)


CRASH_SIGNALS = {
    signal.SIGSEGV: "a crash in native code: a bad memory access",
    signal.SIGBUS: "a crash in native code: a bad memory access",
    signal.SIGILL: "a crash in native code: an illegal instruction",
    signal.SIGFPE: "a crash in native code: an arithmetic fault",
    signal.SIGABRT: "an abort in native code: a failed assertion, or gloo or NCCL ending a rank "
    "whose collectives did not match its peers'",
}
"""Signals a process raises on itself (the kernel for a fault, `abort()` for an
assertion): the program's, never the machine's."""


def classify_death(returncode: int) -> Verdict:
    """A process that ended with `returncode` (negative: the signal) and raised nothing
    we saw: SIGKILL from outside (the OOM killer too) and SIGTERM (a stop) are the
    machine's; a crash signal (`CRASH_SIGNALS`) and SIGINT (a `KeyboardInterrupt` the
    program raised, or its own terminal's Ctrl-C) are the program's; any other end (an
    exit status without a note, another signal) cannot be classified."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        if sig in CRASH_SIGNALS:
            return Verdict(PROGRAM, sig.name, f"killed by {sig.name}, {CRASH_SIGNALS[sig]}")
        kind = MACHINE if sig in (signal.SIGKILL, signal.SIGTERM) else PROGRAM if sig == signal.SIGINT else UNKNOWN
        return Verdict(kind, sig.name, f"killed by {sig.name}")
    return Verdict(UNKNOWN, "exit", f"exit status {returncode}")


CRASH_HEADER = "Fatal Python error: "
"""How faulthandler starts its report of a crash (CPython 3.10 to 3.13)."""
CRASH_READ_BYTES = 64 * 1024
"""How much of a rank's log the crash report reads back (its end)."""


def record_native_crashes() -> None:
    """Under `disttrain run`: have faulthandler write every thread's Python stack to
    this rank's log (`worker_notes.trace_file`) when the process dies of a crash signal,
    so that `report_crash` can show where. A no-op elsewhere or without RANK."""
    import faulthandler

    rank = os.environ.get("RANK", "")
    path = worker_notes.trace_file(int(rank)) if rank.isdigit() else None
    if path is None or faulthandler.is_enabled():  # done already (a warm worker's entry and its script's)
        return
    log = open(path, "a")  # noqa: SIM115  (kept open for the life of the process: faulthandler writes to its fd)
    faulthandler.enable(file=log, all_threads=True)
    STATE.kept.append(log)


def crash_stack(rank: int) -> str | None:
    """The last crash report faulthandler wrote to `rank`'s log (`record_native_crashes`),
    or None: the crashing thread's stack first, as faulthandler orders it."""
    path = worker_notes.trace_file(rank)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - CRASH_READ_BYTES))
            text = f.read(CRASH_READ_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    start = text.rfind(CRASH_HEADER)
    return _program_frames(text[start:]) if start >= 0 else None


def _program_frames(report: str) -> str:
    """A faulthandler report cut to what the user needs on the console: its first line
    and the crashing thread's frames (when the crash was in a thread with no Python
    frames, such as gloo's, the main thread's), without those of the launcher that ran
    the script (runpy, disttrain's entry points); the whole report stays in the log."""
    lines = report.splitlines()
    blocks: list[tuple[str, list[str]]] = []
    for line in lines[1:]:
        if line.startswith(("Current thread", "Thread ")):
            blocks.append((line, []))
        elif line.startswith("  File ") and blocks:
            blocks[-1][1].append(line)
    current = [frames for head, frames in blocks if head.startswith("Current thread") and frames]
    main = [frames for _, frames in blocks if any(f.endswith(" in <module>") for f in frames)]
    if not (current or main):
        return lines[0]
    title = (
        "The Python stack at the crash (most recent call first):"
        if current
        else "The crash was in a thread of native code; the main thread was at (most recent call first):"
    )
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = (current or main)[0]
    shown = [f for f in frames if not _launcher_frame(f[len('  File "') :].split('"', 1)[0], ours)]
    return "\n".join([lines[0], "", title, *(shown or frames)])


def _launcher_frame(path: str, ours: str) -> bool:
    """A frame of what ran the user's script, not of the script: runpy, disttrain."""
    return path.startswith(("<frozen ", ours)) or os.path.basename(path) == "disttrain"


def report_crash(rank: int, returncode: int) -> bool:
    """Hand the launcher a death by signal that is the program's (`classify_death`): a
    crash signal or SIGINT, with the Python stack at the crash when faulthandler wrote
    one. Returns whether a note was written (the caller then waits to be stopped); False
    for the machine's deaths, outside `disttrain run`, or when another note came first."""
    verdict = classify_death(returncode)
    if returncode >= 0 or verdict.kind != PROGRAM:
        return False
    stack = crash_stack(rank)
    where = f"its Python stack at the crash is above (also in {worker_notes.trace_file(rank)})" if stack else ""
    what = verdict.message.removeprefix("killed by ")
    line = f"not retried: rank {rank} died of {what}; the program's error" + (f"; {where}" if where else "")
    return worker_notes.report_not_retried(line, 128 - returncode, traceback=stack)


_MASKS = (
    re.compile(r"\[[0-9a-fA-F.:]+\]:\d+"),
    re.compile(r"0x[0-9a-fA-F]+"),
    re.compile(r"\bpid:? \d+"),
    re.compile(r"\d+(\.\d+)?\s*m?s\b"),
)


def signature(error: str, message: str, step: int) -> str:
    """What two attempts must share to be the same failure: type, message (addresses,
    pointers, pids and durations masked: they differ between attempts) and step."""
    for mask in _MASKS:
        message = mask.sub("#", message)
    return f"{error}: {message} at step {step}" if step > 0 else f"{error}: {message} before the first step"


class JudgedExit(SystemExit):
    """The exit of a rank whose failure disttrain has judged and reported already
    (`dt.Job`'s end): passed through as it is, never judged again."""


def watch_interrupts() -> None:
    """Tell a SIGINT from outside (a stop: the launcher passes on a Ctrl-C) from a
    `KeyboardInterrupt` the program raised itself: the handler records the signal in
    `STATE.interrupted`, then raises as Python's own does. Kept when the process
    already has a handler of its own."""

    def interrupted(_signum, _frame) -> None:
        STATE.interrupted = True
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)


def is_program_exit(exc: BaseException) -> bool:
    """Whether `exc`, ending a script, is the program's own end, which a retry would
    repeat: `sys.exit(n)` with n other than 0 (a message too), or a `KeyboardInterrupt`
    that no SIGINT from outside caused (`watch_interrupts`). Not a `JudgedExit`."""
    if isinstance(exc, JudgedExit):
        return False
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    return isinstance(exc, KeyboardInterrupt) and not STATE.interrupted


def exit_status(exc: BaseException) -> int:
    """The exit status Python gives a process that dies of `exc` (1; a `SystemExit`'s own
    code; 130 for a `KeyboardInterrupt`, as a shell reports a death by SIGINT)."""
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 1
    return 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


def report_early_finish(rank: int, step: int | None, verdict: Verdict) -> bool:
    """After this rank's collective failed (`verdict` not the program's): when a peer's
    code had ended with status 0 in this attempt, that is the cause, and the program's
    (every rank must make the same collectives: a `break`, `return` or `sys.exit(0)` on
    one rank only). Hands the launcher that line and returns True (the caller waits to
    be stopped); False when no peer had finished."""
    peers = worker_notes.finished_peers(rank)
    if verdict.kind == PROGRAM or not peers:
        return False
    where = "" if step is None else f" at step {step}" if step else " before the first step"
    who = f"rank {peers[0]} finished its" if len(peers) == 1 else f"ranks {', '.join(map(str, peers))} finished their"
    return worker_notes.report_not_retried(
        f"not retried: {who} code (a return, a break or an exit 0 on one rank only) while rank "
        f"{rank} still waited in a collective{where} ({verdict.cause}); every rank must make the same "
        f"collectives: the program's error",
        1,
    )


def report_program_error(exc: BaseException, rank: int, step: int | None, oom: dict | None = None) -> bool:
    """Under `disttrain run`: hand the launcher the program's error `exc` of `rank` at
    `step` (0: before the first step; None: a plain script's, unknown), its traceback
    and its one line; `oom`: the planner's facts for an out-of-memory error ({}: none
    known). False elsewhere, or when another rank's report came first. The caller then
    waits to be stopped (`worker_notes.wait_to_be_stopped`) and exits with
    `exit_status(exc)`."""
    where = "" if step is None else f" at step {step}" if step else " before the first step"
    what = (
        f"not retried: rank {rank} called sys.exit({exc.code!r}){where}: the program's own exit"
        if isinstance(exc, SystemExit)
        else f"not retried: {type(exc).__name__}{where} on rank {rank} is the program's error"
    )
    return worker_notes.report_not_retried(
        what,
        exit_status(exc),
        traceback="".join(traceback.format_exception(exc)),
        oom=oom,
    )


def attempt() -> tuple[int, int]:
    """This attempt: (torchrun's restart count, the in-memory generation)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), fault_injection.attempt()


def crash_loop(verdict: Verdict, step: int, unit: str = "attempts") -> bool:
    """The crash-loop breaker, for a failure that cannot be classified: record its
    signature as this attempt's; when the attempt before ended with the same one, tell
    the launcher to stop the job ("two `unit` in a row ...") and return True (the
    caller then waits to be stopped)."""
    sig = signature(verdict.error, verdict.message, step)
    if worker_notes.repeated_failure(attempt(), sig) is None:
        return False
    worker_notes.report_not_retried(
        f"stopped: two {unit} in a row ended with the same failure ({sig}), so a retry would repeat it; not retried", 1
    )
    return True


def repeated_death(rank: int, returncode: int) -> bool:
    """The crash-loop breaker for a rank's end that nobody judged: a kill from outside
    (SIGKILL, the OOM killer) or an exit status without a reported exception
    (`os._exit`). Records rank, how and step as this attempt's failure; when the
    attempt before ended the same way, hands the launcher the note that stops the job
    and returns True (the caller then waits to be stopped). False outside `disttrain
    run`, when no step is known (a plain script: no `dt.Job` marks one), when a rank's
    note already decided the attempt, or when this rank ended because it lost a peer."""
    mark = worker_notes.read_mark(rank)
    if mark is None or worker_notes.earlier_stop() or worker_notes.judged_lost_peer(rank):
        return False
    step, run = mark
    how = f"died of {classify_death(returncode).error}" if returncode < 0 else f"exited with status {returncode}"
    what = f"rank {rank} {how} " + (f"at step {step}" if step else "before its first step")
    if worker_notes.repeated_failure(attempt(), f"{what} (run {run})") is None:
        return False
    line = f"stopped: {what} in two attempts in a row, so a retry would end there again; not retried"
    return worker_notes.report_not_retried(line, 128 - returncode if returncode < 0 else returncode)


def report_hang(reporter: int, lagging: list[int], step: int) -> bool:
    """After the hang watchdog's report: the verdict for the launcher's last line, and the
    crash-loop breaker's record (a hang cannot be classified: the program's deadlock or a
    stalled machine). Returns True when the attempt before hung the same way at the same
    step: the launcher then stops the job instead of restarting it."""
    worker_notes.note_hang(reporter, lagging)
    who = f"rank(s) {', '.join(map(str, lagging))}" if lagging else "no single rank"
    return crash_loop(Verdict(UNKNOWN, "hang", f"{who} stopped making progress"), step)


def say_once(line: str) -> None:
    """One line per failure of an attempt, said by the first rank to see it."""
    restarts, generation = attempt()
    if worker_notes.first_to_say(f"failure-{restarts:06d}-{generation:06d}"):
        LOGGER.warning(line, extra=EVERY_RANK)


def trace_to_log(rank: int, exc: BaseException, header: str = "") -> str:
    """Append `exc`'s traceback (after a `header` line) to this rank's log under
    `disttrain run`; returns where it went, for the rank's one line."""
    path = worker_notes.trace_file(rank)
    if path is None:
        return "no per-rank log outside disttrain run"
    with open(path, "a") as f:
        f.write((header + "\n" if header else "") + "".join(traceback.format_exception(exc)) + "\n")
    return f"full trace in {path}"
