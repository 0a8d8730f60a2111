"""User-facing errors: one clear message that names what is wrong and how to fix it.

The CLI prints these without a traceback and exits with status 2. Anything that is
not a `UserError` is a bug in disttrain or in the user's code and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix. `str(err)` is the whole message: what, where, fix."""


class ConfigError(UserError):
    """A bad config key, type or value, raised before any process group starts."""


class DistributedMismatchError(UserError):
    """Ranks disagree on something they must share (accum_steps, config, model)."""


def run_command(name: str, command, argv: list[str]) -> int:
    """Run `command(argv)` as `disttrain NAME`: a `UserError` prints one line (no
    traceback) and returns 2 (a worker under `disttrain run` hands the line to the
    launcher: `launcher_notes`); Ctrl-C returns 130; anything else propagates."""
    try:
        return int(command(argv) or 0)
    except UserError as e:
        from disttrain.launcher_notes import report_user_error

        return report_user_error(name, e)  # under `disttrain run`: to the launcher, not retried
    except KeyboardInterrupt:
        return 130
