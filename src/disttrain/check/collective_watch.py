"""Collectives called on some ranks only, or with different shapes, dtypes or ops, and a
rank that ends while the others wait: named with each rank's line before they hang.

While the window is open, the collectives of `torch.distributed` (`fingerprints.SPECS`:
all_reduce, broadcast, all_gather, ..., barrier, the `*_object` ones) and
`destroy_process_group` are replaced, as module attributes, by wrappers that pass every
call on unchanged. A call made by the user's code (the caller's frame is not torch's,
disttrain's or the standard library's) on the main thread first becomes an event of
this rank's sequence (`fingerprints.Event`), compared across the group's ranks through
the store (`sequence`) before the real collective runs. The same sequence of the
default group also holds each optimizer step (`step`, from the session's hook) and the
rank's end (`end`: the script returned, `sys.exit(0)`, `destroy_process_group()`), so
rank 0 in an all_reduce while rank 1 steps the optimizer, or has finished, is a
mismatch, seen at once, not a hang.

- Events that differ at one place: a stop (exit 3), one message naming each rank's call
  and line, said by the group's first rank.
- A rank that has not reached the place within the bound (`sequence.wait_bound_s`): one
  warning by each waiting rank, naming the ranks missing and the last call each made;
  then the collective checks stop, on every rank (`sequence.OFF`), and the program goes
  on into its collective as it would without them.
- A store that fails (its host rank is gone): the collective checks stop on this rank.

After the window (the first N optimizer steps; `all`: the whole run) the originals are
back as module attributes; a wrapper the script kept (`from torch.distributed import
all_reduce`) calls the original at once. Not seen: collectives that torch makes itself
(DDP's and FSDP's, from C++ or from torch's own Python), those of other threads, and
point-to-point operations.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch.distributed as dist

from disttrain.check import fingerprints
from disttrain.check.fingerprints import COLLECTIVE, END, STEP, Event
from disttrain.check.sequence import OFF, Missing, Sequence, wait_bound_s
from disttrain.check.settings import ALL
from disttrain.check.verdicts import PREFIX, Finding, Report, own_code, past_checks, stop, user_line
from disttrain.runtime.log import EVERY_RANK, LOGGER

WORLD = "world"
"""The default group's sequence: its collectives, the optimizer steps and the end."""
END_CALL = "destroy_process_group"


class CollectiveWatch:
    """This rank's collectives in the window: `install`, then `step` at each optimizer
    step, `end` when the script ends, `remove` when the window closes."""

    def __init__(self, report: Report, window: int) -> None:
        self.report, self.window = report, window
        self.sequence: Sequence | None = None
        self.active = False
        self.originals: dict[str, Callable] = {}
        self.calls = self.steps = 0
        self.ops: set[str] = set()
        self.stopped_why = ""
        self._signatures: dict[str, inspect.Signature] = {}

    def install(self) -> None:
        for name in [*fingerprints.SPECS, END_CALL]:
            original = getattr(dist, name, None)
            if callable(original):
                self.originals[name] = original
                setattr(dist, name, self._wrapper(name, original))
        self.active = True

    def remove(self) -> None:
        """The window closed: the originals back; peers that go on comparing stop too."""
        self._deactivate(OFF)

    def _deactivate(self, leave: bytes | None) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.originals = {}
        if self.active and self.sequence is not None and leave is not None:
            self.sequence.leave(leave, [WORLD])
        self.active = False
        self.report.note("collectives", self._covered())

    def _covered(self) -> str:
        if self.sequence is None:
            return "not compared (no collective or optimizer step after the process group was up)"
        if self.calls == self.steps == 0 and self.stopped_why:
            return f"not compared ({self.stopped_why})"
        ops = f" ({', '.join(sorted(self.ops))})" if self.ops else ""
        text = f"{self.calls} call{'s' if self.calls != 1 else ''}{ops} and {self.steps} optimizer step"
        text += "" if self.steps == 1 else "s"
        return f"{text} matched across ranks" + (f", then {self.stopped_why}" if self.stopped_why else "")

    def _wrapper(self, name: str, original: Callable) -> Callable:
        watch = self

        @functools.wraps(original)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if watch.active and from_user(sys._getframe(1)):
                watch.guarded(watch.called, name, original, args, kwargs)
            return original(*args, **kwargs)

        return checked

    def guarded(self, action: Callable[..., None], *args: Any) -> None:
        """`action(*args)`; a fault of the checks' own turns them off with one warning, and
        never reaches the script (a stop is no fault: it ends the process)."""
        try:
            action(*args)
        except Exception as e:  # noqa: BLE001  (the checks' own fault must never reach the script)
            LOGGER.warning(
                f"disttrain {PREFIX}: the collective checks failed ({type(e).__name__}: {e}) and stop.",
                extra=EVERY_RANK,
            )
            self.stopped_why = "the checks failed"
            self._deactivate(OFF)

    def called(self, name: str, original: Callable, args: tuple, kwargs: dict) -> None:
        """The user's call of `torch.distributed.<name>`: an event compared before it runs."""
        try:
            if name not in self._signatures:
                self._signatures[name] = inspect.signature(original)
            arguments = self._signatures[name].bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            return  # torch's own call says what is wrong with the arguments
        if name == END_CALL:
            if arguments.get("group") is None:
                self._end("called destroy_process_group()", user_line())
            return
        group = self._group(arguments.get("group"))
        if group is not None:
            self.exchange(*group, fingerprints.collective(name, arguments, user_line()))

    def _group(self, group: Any) -> tuple[str, list[int]] | None:
        """(the group's sequence, its global ranks) for a call on `group` that this rank
        makes with others; None without a process group, or for a group without it."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        if group is None or group is dist.group.WORLD:
            ranks = list(range(dist.get_world_size()))
            key = WORLD
        else:
            try:
                ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError, AttributeError):  # not a group of this rank's
                return None
            key = "group-" + str(getattr(group, "group_name", "")).replace("/", "_")
        return (key, ranks) if len(ranks) > 1 and dist.get_rank() in ranks else None

    def step(self) -> None:
        """An optimizer step (the session's pre-hook): an event of the default group;
        past the window, the collectives are no longer watched. Never raises."""
        if self.active:
            self.guarded(self._step)

    def _step(self) -> None:
        group = self._group(None)
        if group is not None:
            self.exchange(*group, Event(STEP, line=user_line() or ""))
        self.steps += 1
        if self.active and self.window != ALL and self.steps > self.window:
            self.remove()

    def end(self, shown: str | None = None, line: str | None = None) -> None:
        """This rank's end, for its peers: a clean one (the script returned, `sys.exit(0)`,
        `destroy_process_group()`) is an event they compare with theirs; during a failure
        (the launcher reports it) the checks only stop. Never raises."""
        if self.active:
            self.guarded(self._end, shown, line)

    def _end(self, shown: str | None, line: str | None) -> None:
        failure = sys.exc_info()[1]
        if failure is not None and not (isinstance(failure, SystemExit) and failure.code in (None, 0)):
            return self._deactivate(OFF)
        if shown is None and isinstance(failure, SystemExit):
            shown, line = f"called sys.exit({failure.code!r})", _raised_at(failure.__traceback__)
        event = Event(END, shown=shown or "finished", line=line or "")
        group = self._group(None)
        if self.sequence is not None:
            self.sequence.leave(event.to_json().encode(), [])  # a peer waiting in a smaller group reads it
        if group is not None:
            self.exchange(*group, event)
        self._deactivate(None)

    def exchange(self, group: str, members: list[int], event: Event) -> None:
        """Compare `event` with the group's other ranks: a stop on a mismatch, a warning
        for ranks missing past the bound. Never raises."""
        if self.sequence is None:
            self.sequence = Sequence(dist.get_rank(), wait_bound_s())
        try:
            got = self.sequence.exchange(group, members, event.to_json().encode())
        except (RuntimeError, KeyError, ValueError, OSError) as e:  # the store is gone (its host rank)
            if event.kind != END:
                LOGGER.warning(
                    f"disttrain {PREFIX}: rank {self.sequence.rank} could not compare its collectives with the "
                    f"other ranks through the job's store at MASTER_ADDR:MASTER_PORT ({type(e).__name__}: "
                    f"{str(e)[:200]}); the collective checks stop.",
                    extra=EVERY_RANK,
                )
            self.stopped_why = "the store failed"
            return self._deactivate(None)
        if isinstance(got, Missing):
            return self._missing(got, event, group, members)
        if got is None or any(e is None for e in got):
            self.stopped_why = "another rank stopped its checks"
            return self._deactivate(None)
        text = fingerprints.mismatch_text([e for e in got if e is not None], members, self._where(group, members))
        if text is not None:
            self.report.found.append(Finding("collectives", True, text))
            stop(text, speaker=members[0])
        if event.kind == COLLECTIVE:
            self.calls += 1
            self.ops.add(event.op)

    def _where(self, group: str, members: list[int]) -> str:
        steps = f"after {self.steps} optimizer step{'s' if self.steps > 1 else ''}"
        at = steps if self.steps else "before the first optimizer step"
        return at if group == WORLD else f"{at}, in the group of {fingerprints.ranks_words(members)}"

    def _missing(self, missing: Missing, event: Event, group: str, members: list[int]) -> None:
        """The bound passed: one warning from this rank (not for its end: a peer still at
        work is no bug), and the collective checks stop."""
        self.stopped_why = "a rank was not there within the bound"
        self._deactivate(OFF)
        if event.kind == END:
            return
        assert self.sequence is not None
        me, who = self.sequence.rank, fingerprints.ranks_words(missing.ranks)
        last = "; ".join(
            fingerprints.describe(f"rank {r}", e) if e else f"rank {r} has made no call yet"
            for r, e in missing.last.items()
        )
        text = (
            f"{self._where(group, members)}: "
            f"{fingerprints.describe(f'rank {me}', event)} and has waited {self.sequence.bound_s:g} s for "
            f"{who}, which {'has' if len(missing.ranks) == 1 else 'have'} not reached it (last: {last}). If "
            f"{who} {'is' if len(missing.ranks) == 1 else 'are'} busy on purpose (an evaluation or a save on one "
            "rank), this is only slow; otherwise that call runs on some ranks only and this rank will hang in "
            "it. The collective checks stop here (DISTTRAIN_CHECK_WAIT_S sets the wait)."
        )
        self.report.found.append(Finding("collectives", False, text))
        LOGGER.warning(f"disttrain {PREFIX} warning: {text}", extra=EVERY_RANK)


def from_user(caller: FrameType) -> bool:
    """Whether a call whose caller's frame is `caller` is the user's, on the main thread
    (the checks' own wrappers in between skipped)."""
    frame = past_checks(caller)
    return (
        threading.current_thread() is threading.main_thread()
        and frame is not None
        and not own_code(frame.f_code.co_filename)
    )


def _raised_at(tb: TracebackType | None) -> str | None:
    """The user's innermost line in a traceback (where `sys.exit` was called)."""
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return user_line(frame) if frame is not None else None
