"""Checkpoint errors: each names the directory or file, what is wrong, and the fix."""

from __future__ import annotations

from disttrain.errors import UserError


class CheckpointError(UserError):
    """Base of every checkpoint problem a user can act on."""

    # A failed save's first sentence, without what stays latest: set (only) by the
    # writer that raises it, for a later save to report it (Checkpointer.save)
    head: str


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint is incomplete or a file fails its size or checksum check.

    `bad_file` is the first file that failed (relative to the step directory)."""

    def __init__(self, message: str, bad_file: str = ""):
        super().__init__(message)
        self.bad_file = bad_file

    def __reduce__(self):  # DCP pickles a rank's failure to the others: keep `bad_file`
        return type(self), (str(self), self.bad_file)


class CheckpointUnsafe(CheckpointCorrupt):
    """A checkpoint folder asks for something a checkpoint never holds: a pickle naming
    a foreign class, a file name that leaves the folder, a symlink out of it. Refused
    before anything of it runs or is read. A `CheckpointCorrupt`, so no bookkeeping
    ever trusts the folder; but a load refuses it even with `fallback` on, and
    `ckpt verify` exits 2: someone wrote it on purpose."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint does not fit the model/optimizer it is loaded into."""


class CheckpointSaveError(CheckpointError):
    """A save failed (on any rank). Raised on every rank; the previous checkpoint stays
    latest and intact."""


class StaleWriterError(CheckpointError):
    """Another job (a newer writer generation) owns the checkpoint directory: this
    writer was fenced. Deliberately not a `CheckpointSaveError`, so
    `checkpoint.on_error = "continue"` never applies: a fenced job must stop, since
    two jobs must never train into one directory."""
