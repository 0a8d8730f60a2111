"""The launcher's side of `disttrain.launcher_notes`: a folder for this launch's notes,
and a watcher that stops the job at the first rank's user error.

`watch()` makes the folder, names it in the workers' environment and starts a daemon
thread that polls it. When a `user-error` note appears the thread sends SIGTERM to
this process: torchrun's agent then stops the workers (the reporting one waits for
it) instead of restarting them, and `disttrain run` prints the note's one line and
exits 2 (`Notes.report`).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading

from disttrain import launcher_notes

POLL_S = 0.05


class Notes:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="disttrain-notes-")
        os.environ[launcher_notes.NOTES_ENV] = self.folder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="disttrain-notes", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            if launcher_notes.read_user_error(self.folder) is not None:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent stops the workers: no restart
                return

    def user_error(self) -> str | None:
        return launcher_notes.read_user_error(self.folder)

    def report(self) -> int:
        """Print the user error's line (once, from the launching process); returns 2."""
        print(self.user_error(), file=sys.stderr, flush=True)
        return 2

    def saved_step(self) -> int | None:
        return launcher_notes.read_saved(self.folder)

    def close(self) -> None:
        self._stop.set()
        os.environ.pop(launcher_notes.NOTES_ENV, None)
        shutil.rmtree(self.folder, ignore_errors=True)


def watch() -> Notes:
    return Notes()
