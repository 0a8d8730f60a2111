"""The Python stacks of a job's local ranks, for a hang report (P-DEBUG-1).

py-spy reads a process's stacks from outside without stopping it (a stopped or
GIL-holding process included); without it, each rank's watchdog has registered
faulthandler on SIGUSR1 and writes its own stacks to a file in the side channel.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from disttrain.guard import private_dir


def find_py_spy() -> str | None:
    """py-spy next to this interpreter (a venv) or on PATH; None when not installed.

    `DISTTRAIN_PY_SPY` overrides: a path to the binary, or 0 to use faulthandler only.
    """
    choice = os.environ.get("DISTTRAIN_PY_SPY")
    if choice is not None:
        return None if choice in ("", "0") else choice
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.is_file() else shutil.which("py-spy")


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of a local process ('T' stopped, 'Z' zombie), or '?'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def dump_stacks(beats: list[dict], dir: Path) -> dict[int, str]:
    """Python stacks of the local ranks in `beats`: py-spy, else their faulthandler files.
    Every pid in `beats` is signalled (SIGUSR1): the caller passes only processes it
    checked to be its job's own (`watchdog._same_process`)."""
    py_spy = find_py_spy()
    stacks: dict[int, str] = {}
    if py_spy:
        # --nonblocking reads memory without pausing: safe on a stopped process.
        procs = {
            b["rank"]: subprocess.Popen(
                [py_spy, "dump", "--nonblocking", "--pid", str(b["pid"])],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for b in beats
        }
        for rank, proc in procs.items():
            try:
                stacks[rank] = proc.communicate(timeout=20)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                stacks[rank] = "(py-spy timed out)"
        if all(s.strip() and "Error" not in s[:200] for s in stacks.values()):
            return stacks
    for b in beats:  # faulthandler fallback; a stopped process answers only once resumed
        # Only running watchdogs have the handler; SIGUSR1's default action would kill.
        if b.get("proc_state") != "T" and b.get("state") == "running":
            try:
                os.kill(b["pid"], signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(1.0)
    for b in beats:
        if not stacks.get(b["rank"], "").strip() or "Error" in stacks[b["rank"]][:200]:
            try:
                text = private_dir.read(dir / f"stack{b['rank']}.txt").decode(errors="replace")
            except OSError:
                text = ""
            stacks[b["rank"]] = text or f"(no stack: process state {b.get('proc_state', '?')})"
    return stacks
