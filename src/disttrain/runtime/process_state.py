"""The one registry of the values that describe this process (`STATE`): its process
group, its handles, its once-only flags. Every process-wide value the package keeps is
a field here, read and written through the functions of the module that owns it (named
per field); no module keeps a `global` of its own (tests/faults/test_processes.py). Pure
caches (a mesh per group, a thread pool per size) and constants stay in their modules.
Imports nothing of the package: log.py and processes.py both read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ProcessState:
    """What describes this process, for as long as it lives (one instance: `STATE`).
    Fields typed `Any` hold objects of higher layers, which this module must not import;
    each is read and written only through its owner's functions (named per field)."""

    rank_info: Any = None
    """runtime.RankInfo of the running process group (process_group.init/shutdown)."""
    lingering_groups: list = dataclasses.field(default_factory=list)
    """Destroyed process groups something still references (process_group.shutdown)."""
    last_place: tuple[int, int] | None = None
    """(rank, world) of the last process group `process_group.init` started here."""
    exit_hook_set: bool = False
    """Whether process_group registered its at-exit release of `lingering_groups`."""
    thaw_at_shutdown: bool = False
    """`freeze_long_lived` made the first freeze: `thaw_long_lived` may undo it."""
    frozen: bool = False
    """`freeze_long_lived` has frozen since the last thaw (the count is not 0: no need to walk it)."""
    handoff: Any = None
    """elastic.fast_recovery.Handoff of the generation running now (fast_recovery.run)."""
    watchdog: Any = None
    """guard.script_watchdog.ScriptWatchdog running in this process, if any."""
    speaker: str = "disttrain"
    """Who this process's messages are from (log.set_speaker)."""
    faults: Any = None
    """runtime.fault_injection's active faults (None: read DISTTRAIN_FAULT on next use)."""
    attempt: int = 0
    """In-memory recoveries so far (fault_injection.set_attempt)."""
    load_phases: Any = None
    """The phases of the checkpoint load being recorded (checkpoint.load_phases)."""
    announced_pid: int | None = None
    """The pid that said its rank (`name_worker`; a fork is a new process)."""
    kept: list = dataclasses.field(default_factory=list)
    """Objects kept alive until the interpreter exits and never destructed (a finished
    script's globals, objects whose destructor would abort at finalization)."""
    said: set = dataclasses.field(default_factory=set)
    """Keys of the once-per-process messages already given (`first_time`)."""
    interrupted: bool = False
    """A SIGINT reached this process from outside (failures.watch_interrupts)."""


STATE = ProcessState()
"""This process's registry. A forked child inherits a copy, as it does every global."""


def first_time(key: str) -> bool:
    """True the first time this process asks with `key`, False after: a message given
    once per process."""
    if key in STATE.said:
        return False
    STATE.said.add(key)
    return True
