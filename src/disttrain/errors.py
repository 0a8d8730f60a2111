"""User-facing errors: one clear message that names what is wrong and how to fix it.

The CLI prints these without a traceback and exits with status 2. Anything that is
not a `UserError` is a bug in disttrain or in the user's code and keeps its traceback.
"""

from __future__ import annotations


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
    majority. A `UserError`.
    """


def run_command(name: str, command, argv: list[str]) -> int:
    """Run `command(argv)` as `disttrain NAME`: a `UserError` prints one line (no
    traceback) and returns 2 (a worker under `disttrain run` hands the line to the
    launcher: `worker_notes`); Ctrl-C returns 130; anything else propagates."""
    try:
        return int(command(argv) or 0)
    except UserError as e:
        from disttrain.worker_notes import report_user_error

        return report_user_error(name, e)  # under `disttrain run`: to the launcher, not retried
    except KeyboardInterrupt:
        return 130
