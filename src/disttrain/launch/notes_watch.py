"""The launcher's side of `disttrain.worker_notes`: a folder for this launch's notes,
and a watcher that stops the job at the first rank's user error or failure that is not
retried (the program's own error, a crash loop: `runtime.failures`).

`watch()` makes the folder, names it in the workers' environment and starts a daemon
thread that polls it. When a `user-error` or `not-retried` note appears the thread
sends SIGTERM to this process: torchrun's agent then stops the workers (the reporting
one waits for it) instead of restarting them, and `disttrain run` prints the note
(`Notes.report`): a user error's one line, exit 2; a failure's traceback, then its one
line (with the planner's estimate and the fixes for an out-of-memory error), exit
with its status. The per-rank logs of full tracebacks (`worker_notes.trace_file`)
go to a second folder, kept after the job only when a rank wrote there.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable

from disttrain import worker_notes

POLL_S = 0.05
ASK_EVERY_S = 0.5


class Notes:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="disttrain-notes-")
        self.traces = tempfile.mkdtemp(prefix="disttrain-traces-")
        os.environ[worker_notes.NOTES_ENV] = self.folder
        os.environ[worker_notes.TRACES_ENV] = self.traces
        self._stop = threading.Event()
        self.on_stop: Callable[[], None] | None = None
        """Called once a rank's note stops the job, before the workers are stopped
        (`elastic.note_relay`: the note goes to the other nodes first)."""
        self._thread = threading.Thread(target=self._poll, name="disttrain-notes", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.stopped():
                quiet_torchrun()
                if self.on_stop is not None:
                    self.on_stop()
                os.kill(os.getpid(), signal.SIGTERM)  # the agent stops the workers: no restart
                return

    def ask_others(self, ask: Callable[[], object]) -> None:
        """Call `ask` every `ASK_EVERY_S` on a thread of its own until the job ends or a
        note stops it: it copies a note another node relayed into this folder
        (`elastic.note_relay.adopt`), so that this node stops too wherever its agent
        waits (its exit barrier, a rendezvous). Its own thread: a store that does not
        answer must not delay this node's own notes."""

        def loop() -> None:
            while not self._stop.wait(ASK_EVERY_S) and not self.stopped():
                try:
                    ask()
                except Exception:  # a relay that fails is no note; the watcher goes on
                    continue

        threading.Thread(target=loop, name="disttrain-notes-relay", daemon=True).start()

    def stopped(self) -> bool:
        """Whether a rank asked for the job to stop: a user error or a failure not retried."""
        return (
            worker_notes.read_user_error(self.folder) is not None
            or worker_notes.read_not_retried(self.folder) is not None
        )

    def stop_note(self) -> tuple[str, str] | None:
        """The note that stops the job, as the rank wrote it (`worker_notes.read_stop`)."""
        return worker_notes.read_stop(self.folder)

    def report(self) -> int:
        """Print what stopped the job (once, from the launching process, last) and
        return the job's exit status: a user error's line (2), or a failure's
        traceback and line (its status)."""
        line = worker_notes.read_user_error(self.folder)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            return 2
        record = worker_notes.read_not_retried(self.folder) or {}
        text = record.get("line", "a rank stopped the job")
        if record.get("oom") is not None:
            from disttrain.launch.oom_advice import advice

            text += f"; {advice(record['oom'])}"
        if record.get("traceback"):
            print(record["traceback"].rstrip(), file=sys.stderr)
        status = int(record.get("status") or 1)
        print(f"disttrain run: {text} (exit status {status}).", file=sys.stderr, flush=True)
        return status

    def hang(self) -> dict | None:
        """The hang watchdog's verdict of the newest attempt, if a rank reported one."""
        return worker_notes.read_hang(self.folder)

    def failed_attempts(self) -> int:
        """How often the job failed and went on in this launch (restarts, generations)."""
        return worker_notes.failed_attempts(self.folder)

    def lost_peer_ranks(self) -> list[int]:
        """The ranks that ended the last attempt because they lost a peer."""
        return worker_notes.lost_peer_ranks(self.folder)

    def shrunk(self) -> dict | None:
        """The newest in-memory shrink of this node's ranks (`worker_notes.note_shrunk`)."""
        return worker_notes.read_shrunk(self.folder)

    def stood_by(self) -> bool:
        """Whether this node's slots were hot spares that ended standing by."""
        return worker_notes.read_stood_by(self.folder)

    def restart_path(self) -> dict | None:
        """The slot of this node whose fast recovery ended for torchrun's restart path,
        and why (`worker_notes.note_restart_path`)."""
        return worker_notes.read_restart_path(self.folder)

    def agents_gone(self, local_world: int) -> int:
        """How many nodes the job lost: those of the slots lost in its shrinks or taken
        over by spares, and of the hot-spare slots lost while standing by (torchrun
        numbers the slots node by node, `local_world` a node). A job a rank stopped
        waits for no other node: each node's launcher stops its own."""
        if self.stopped():
            return 1 << 30
        record = self.shrunk() or {}
        slots = [*record.get("lost", []), *worker_notes.read_standby_lost(self.folder)]
        return len({int(slot) // max(1, local_world) for slot in slots})

    def saved_step(self) -> int | None:
        return worker_notes.read_saved(self.folder)

    def close(self) -> None:
        self._stop.set()
        os.environ.pop(worker_notes.NOTES_ENV, None)
        os.environ.pop(worker_notes.TRACES_ENV, None)
        shutil.rmtree(self.folder, ignore_errors=True)
        try:  # kept when a rank wrote there; the empty logs every rank opens at start go
            for entry in os.scandir(self.traces):
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size == 0:
                    os.unlink(entry.path)
            os.rmdir(self.traces)
        except OSError:
            pass


def quiet_torchrun() -> None:
    """Silence torchrun's own warnings while it stops a job on a rank's note: its
    "Received 15 death signal" and "Sending process N closing signal" lines would read
    as a signal from outside, above the note's own line that says what happened."""
    import logging

    names = [n for n in list(logging.Logger.manager.loggerDict) if n.startswith("torch.distributed.elastic")]
    for name in ["torch.distributed.elastic", *names]:
        logging.getLogger(name).setLevel(logging.ERROR)


def watch() -> Notes:
    return Notes()
