"""User-facing errors: one clear message that names what is wrong and how to fix it.

The CLI prints these without a traceback and exits with status 2. Anything that is
not a `UserError` is a bug in disttrain or in the user's code and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A mistake the user can fix. `str(err)` is the whole message: what, where, fix.

    The base of every error disttrain raises on purpose. The `disttrain` commands print
    it as one line without a traceback and exit with status 2; under `disttrain run`
    a worker's `UserError` is reported once by the launcher and never retried. In your
    own script it propagates like any exception. Anything else disttrain raises is a
    bug (in disttrain or in the code it runs) and keeps its traceback.
    """


class ConfigError(UserError):
    """A bad config key, type or value, raised before any process group starts.

    Raised by `disttrain train`'s config loading (an unknown key names the closest
    known one), by `dt.wrap` for an unknown option or an illegal combination of
    strategy, precision and compile, and by `dt.Layout` for a grid that does not
    cover the world. A `UserError`: nothing has been changed when it is raised.
    """


class DistributedMismatchError(UserError):
    """Ranks disagree on something they must share (accum_steps, config, model).

    Raised on every rank at once, from the same gathered data, by the collective
    checks: `dt.check_consistency`, `dt.start_guard`, `dt.check_replicas`, and the
    `dt.Accumulator` and `dt.Job` start checks. The message names the field or
    parameter that differs, each rank's value and the ranks that differ from the
    majority. A `UserError`. `fingerprints`: what each rank sent, in rank order, where
    the check compared whole fingerprints (`dt.start_guard`, `dt.check_consistency`);
    empty otherwise.
    """

    def __init__(self, message: str, fingerprints: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.fingerprints = fingerprints or []


class Exit:
    """The exit status a `one_line` block ends with: what the command returned, or the
    status of the error it raised."""

    code: int = 0


@contextmanager
def one_line(name: str) -> Iterator[Exit]:
    """Run the block as `disttrain NAME`: a `UserError` (a `ConfigError` included) raised
    anywhere in it prints one line, with no traceback, and sets the status to 2 (a
    worker under `disttrain run` hands the line to the launcher: `worker_notes`);
    Ctrl-C sets 130; anything else propagates. The block sets `code` on success:

        with one_line("train") as result:
            result.code = main(argv)
        return result.code
    """
    result = Exit()
    try:
        yield result
    except UserError as e:
        from disttrain.worker_notes import report_user_error

        result.code = report_user_error(name, e)  # under `disttrain run`: to the launcher, not retried
    except KeyboardInterrupt:
        result.code = 130
