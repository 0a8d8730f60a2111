"""What the launcher of `disttrain train` found, handed to its ranks so they do not find
it again: the validated config and the resume inspection (`resume.Inspected`).

The launcher parses and validates the config, runs the preflight and inspects the
newest checkpoint once (launch/train_command.py); `handed` writes the result as JSON
into a file only the user can read (0600, in a 0700 temporary folder the launcher
owns), names it in `ENV` for the workers, and removes both when the job is over. A rank
reads it (`read`) instead of loading the TOML and reading the checkpoint again, but
only on its first attempt: after a torchrun restart or in a later generation of a fast
recovery (a promoted spare) the checkpoint may have changed, so such a rank parses and
inspects itself, as does a rank whose arguments are not the ones the file was written
for (an `ENV` left in an outer environment).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from disttrain.config import Config, to_dict
from disttrain.config.tomlfile import build
from disttrain.elastic.fast_recovery import ROLE_ENV
from disttrain.errors import ConfigError
from disttrain.train.resume_plan import Inspected

ENV = "DISTTRAIN_LAUNCHED"
"""The handed file's path, in the workers' environment."""
FILE = "launched.json"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of this worker group's restarts (0 on the first attempt)."""


@dataclass(frozen=True)
class Launched:
    """The launcher's result for the ranks: `argv` (CONFIG.toml and the overrides, as
    the ranks get them), the validated `cfg`, and `inspected` (None: the ranks inspect)."""

    argv: tuple[str, ...]
    cfg: Config
    inspected: Inspected | None = None

    def to_json(self) -> dict:
        return {
            "argv": list(self.argv),
            "config": to_dict(self.cfg),
            "inspected": None if self.inspected is None else {"plan": self.inspected.to_json()},
        }

    @staticmethod
    def from_json(data: dict) -> Launched:
        inspected = data["inspected"]
        return Launched(
            tuple(data["argv"]),
            build(Config, data["config"]),
            None if inspected is None else Inspected.from_json(inspected["plan"]),
        )


@contextmanager
def handed(launched: Launched | None) -> Iterator[Path | None]:
    """For the block (the launch): `launched` in a private file named by `ENV`, removed
    with its folder and the variable afterwards. None: no file, and an `ENV` inherited
    from outside is taken out of this launch's environment."""
    previous = os.environ.pop(ENV, None)
    folder = tempfile.mkdtemp(prefix="disttrain-launched-") if launched is not None else None
    try:
        path = None
        if folder is not None and launched is not None:
            path = Path(folder) / FILE
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(launched.to_json(), f)
            os.environ[ENV] = str(path)
        yield path
    finally:
        os.environ.pop(ENV, None)
        if previous is not None:
            os.environ[ENV] = previous
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def first_attempt() -> bool:
    """Whether this process is its slot's first training process of the job: torchrun's
    restart 0, and not a fast recovery's spare or promoted newcomer."""
    return os.environ.get(RESTART_ENV, "0") in ("", "0") and os.environ.get(ROLE_ENV, "") not in ("spare", "newcomer")


def read(argv: list[str]) -> Launched | None:
    """The launcher's result for a rank started with `argv`, or None (parse and inspect
    here): no handed file, not the first attempt (`first_attempt`), other arguments,
    or a file that cannot be read."""
    path = os.environ.get(ENV, "")
    if not path or not first_attempt():
        return None
    try:
        launched = Launched.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, ConfigError):  # ValueError: bad JSON
        return None
    return launched if list(launched.argv) == list(argv) else None
