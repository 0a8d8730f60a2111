"""disttrain's one logger, `logging.getLogger("disttrain")`, and who of the ranks speaks.

    from disttrain.runtime.log import LOGGER, EVERY_RANK
    LOGGER.info("generation 2: state restored")            # rank 0 only
    LOGGER.warning("rank 3: the buddy copy is off", extra=EVERY_RANK)   # this rank's own news

- Ranks: by default only global rank 0's records pass, so a message that every rank
  would say is said once. A record about one rank's own event (a fault injected there,
  its watchdog firing) passes `extra=EVERY_RANK` and is shown by whichever rank logs
  it. `DISTTRAIN_LOG_RANKS=all` lets every rank's records through, each prefixed
  `[rank N]`; `DISTTRAIN_LOG_RANKS=0,3` picks ranks.
- Warnings: a warning with the same text is shown once per process, so with the rank
  filter once per job.
- Level and handlers are the application's, as for any library:
  `logging.getLogger("disttrain").setLevel(logging.WARNING)` keeps only warnings. The
  default level is INFO (disttrain's notes are meant to be read). Unless the application
  gave the "disttrain" logger a handler of its own (a `NullHandler` too) before this
  module was imported, a default handler prints each message, bare, to the current
  `sys.stderr` (flushed: workers' lines reach torchrun at once), and the logger does
  not propagate, so nothing is printed twice. To route disttrain's records to the
  application's handlers: `LOGGER.removeHandler(DEFAULT_HANDLER); LOGGER.propagate = True`.
The progress bar and summary tables are not log records: they stay rich output.
"""

from __future__ import annotations

import logging
import os
import sys

from disttrain.runtime.process_state import STATE

RANKS_ENV = "DISTTRAIN_LOG_RANKS"
EVERY_RANK = {"every_rank": True}
"""`extra=` for a record about this rank's own event: shown by any rank."""


def set_speaker(name: str) -> None:
    """Who this process's messages say they are from: 'disttrain job' (a `dt.Job`
    script) or 'disttrain train' (the config-driven trainer); `dt.Job` sets it."""
    STATE.speaker = name


def speaker() -> str:
    """The prefix of a message from a part both ways in share (fast recovery, the buddy
    copy): what `set_speaker` set, 'disttrain' before a Job exists."""
    return STATE.speaker


def current_rank() -> int:
    """This process's global rank: the process group's when one is running (ranks move
    in an in-memory recovery), else torchrun's `RANK`, else 0. Imports nothing."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (RuntimeError, ValueError):  # a group being torn down
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Passes rank 0's records (or those of the ranks in DISTTRAIN_LOG_RANKS, read per
    record), records marked EVERY_RANK, and each warning text once per process."""

    def __init__(self) -> None:
        super().__init__()
        self.warned: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        chosen = os.environ.get(RANKS_ENV, "").strip()
        if chosen == "all":
            shown = True
        elif chosen:
            shown = str(rank) in {part.strip() for part in chosen.split(",")}
        else:
            shown = rank == 0
        if not (shown or getattr(record, "every_rank", False)):
            return False
        if record.levelno == logging.WARNING:
            text = record.getMessage()
            if text in self.warned:
                return False
            self.warned.add(text)
        if chosen == "all" and not getattr(record, "rank_prefixed", False):
            record.msg, record.args = f"[rank {rank}] {record.getMessage()}", None
            record.rank_prefixed = True
        return True


class StderrHandler(logging.Handler):
    """Writes each record's message to `sys.stderr` as it is at that moment (tests
    capture it, warm workers replace it) and flushes."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's contract: never raise from emit)
            self.handleError(record)


LOGGER = logging.getLogger("disttrain")
RANK_FILTER = RankFilter()
LOGGER.addFilter(RANK_FILTER)
if LOGGER.level == logging.NOTSET:
    LOGGER.setLevel(logging.INFO)
DEFAULT_HANDLER: logging.Handler | None = None
if not LOGGER.handlers:  # the application's own handler, a NullHandler too, wins
    DEFAULT_HANDLER = StderrHandler()
    DEFAULT_HANDLER.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(DEFAULT_HANDLER)
    LOGGER.propagate = False
