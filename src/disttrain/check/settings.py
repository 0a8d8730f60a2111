"""`disttrain run --check [--check-steps N|all]`: the flags, and the window they hand to
the ranks in `CHECK_ENV`. Plain Python, no torch: the launcher parses them before any
worker starts.

The window is the number of optimizer steps checked from the first one (`ALL` for every
step), plus the first step of the training loader's second epoch, wherever it falls.
"""

from __future__ import annotations

import os

CHECK_ENV = "DISTTRAIN_CHECK"
"""Set for the ranks: the steps to check (a number >= 1, or "all"); unset: no checks."""
CHECK_FLAG = "--check"
STEPS_FLAG = "--check-steps"
DEFAULT_STEPS = 50
ALL = -1
"""The window of `--check-steps all`: every optimizer step."""


def parse_steps(raw: str) -> int:
    """The window of `--check-steps RAW`: a number of steps >= 1, or `ALL`. Raises
    ValueError naming the flag for anything else."""
    raw = raw.strip()
    if raw == "all":
        return ALL
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError(
        f"{STEPS_FLAG} is {raw!r}; give the number of optimizer steps to check (at least 1, "
        f"for example {STEPS_FLAG} 20), or 'all' for every step."
    )


def take_check_flags(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """`flags` (disttrain run's, before the script) without `--check` and `--check-steps
    N`, and the env that turns the checks on in the ranks (empty without `--check`).
    `--check-steps` alone implies `--check`. Raises `UserError` for a bad step count,
    in the launcher, before any worker starts."""
    from disttrain.errors import UserError

    kept, steps, wanted, i = [], str(DEFAULT_STEPS), False, 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        if flags[i] == CHECK_FLAG:
            wanted = True
        elif name == STEPS_FLAG:
            if not eq and i + 1 >= len(flags):
                raise UserError(f"{STEPS_FLAG} needs a value: a number of optimizer steps, or 'all'.")
            steps, wanted = (value if eq else flags[i + 1]), True
            i += 0 if eq else 1
        else:
            kept.append(flags[i])
        i += 1
    if not wanted:
        return kept, {}
    try:
        parse_steps(steps)
    except ValueError as e:
        raise UserError(str(e)) from None
    return kept, {CHECK_ENV: steps.strip()}


def window_from_env(env: dict | None = None) -> int | None:
    """The window set by `disttrain run --check` for this rank (`ALL` for every step),
    or None when the checks are off (or the value is not one the launcher writes)."""
    raw = (os.environ if env is None else env).get(CHECK_ENV, "")
    if not raw:
        return None
    try:
        return parse_steps(raw)
    except ValueError:
        return None
