"""The checks of what a run reports and keeps: numbers printed on rank 0 (`numbers`),
checkpoint files (`saves`), random states restored (`rng_restore`) and float16 training
(`float16`).

Each watch records on its own rank; `exchange` gathers every rank's records on the
checks' channel and judges them the same way on every rank, at points every rank
reaches alike: a checked optimizer step where some rank has records (`pending`, sent
with the session's own numbers), and the window's end -- the step after it,
the script's return (worker_entry), or its `destroy_process_group()` (wrapped here;
not when an exception is on its way, where a rank may be alone). `float16` also
exchanges inside `GradScaler.step`, which every rank calls at the same iteration.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from disttrain.check import float16, numbers, rng_restore
from disttrain.check.channel import Channel
from disttrain.check.model_watch import ModelWatch
from disttrain.check.patches import Patches
from disttrain.check.saves import SaveWatch
from disttrain.check.verdicts import Report


class Results:
    """The four watches, installed and removed together, exchanged together."""

    def __init__(
        self,
        models: ModelWatch,
        channel: Channel,
        report: Report,
        steps: Callable[[], int],
        upcoming: Callable[[], int | None],
        at_end: Callable[[], None],
    ) -> None:
        """`steps()`: optimizer steps taken; `upcoming()`: the next step's number when
        it is checked; `at_end()`: the window's last exchange and close (the session's)."""
        self.models, self.channel, self.report, self.at_end = models, channel, report, at_end
        self.numbers = numbers.NumberWatch(lambda: channel.group, steps)
        self.saves = SaveWatch()
        self.rng = rng_restore.RngWatch()
        self.float16 = float16.Float16Watch(upcoming, channel.gather)
        self.seen = {"evaluation": 0, "torch.save call": 0, "RNG restore": 0, "unscaled float16 step": 0}
        self.active = False
        self._patches = Patches()

    def install(self) -> None:
        self.active = True
        self.models.root_calls += [self.numbers.root_call, self.float16.root_call]
        self.numbers.install()
        self.saves.install()
        self.rng.install()
        self.float16.install(self.report)
        self._patches.wrap(dist, "destroy_process_group", self._destroy)

    def remove(self) -> None:
        self.active = False
        for watch in (self.numbers, self.saves, self.rng, self.float16):
            watch.remove()
        self._patches.restore()

    def pending(self, params: list[torch.Tensor] | None) -> bool:
        """Whether this rank has records to exchange at the step with `params` (the
        session sends the flag with its own numbers, and calls `exchange` when any rank
        has some: most steps need no second exchange)."""
        return any(w.pending() for w in (self.numbers, self.saves, self.rng)) or self.float16.pending(params)

    def exchange(self, step: int, params: list[torch.Tensor] | None, step_line: str | None) -> bool:
        """Every rank's records since the last exchange, judged; False when the channel
        is broken. At a checked step `params` are the optimizer's; None at the end."""
        mine = {
            "numbers": self.numbers.take(),
            "saves": self.saves.take(),
            "rng": self.rng.take(),
            "float16": self.float16.take(params),
        }
        rows = self.channel.gather_json(mine)
        if rows is None:
            return False
        if not all(isinstance(r, dict) and r.keys() == mine.keys() for r in rows):
            raise ValueError("a rank's records are not the checks' own")  # _guarded: the checks stop
        self._count(rows)
        found = [
            *numbers.judge([r["numbers"] for r in rows]),
            *self.saves.judge([r["saves"] for r in rows]),
            *rng_restore.judge([r["rng"] for r in rows]),
            *float16.judge([r["float16"] for r in rows], step, step_line),
        ]
        for key, finding in sorted(found, key=lambda kf: kf[1].stops):  # warnings first: a stop ends the run
            self.report.add(finding, key)
        return True

    def _count(self, rows: list[dict]) -> None:
        mine, seen = rows[0], self.seen
        seen["evaluation"] += len(mine["numbers"])
        seen["torch.save call"] += sum(len(r["saves"]) for r in rows)
        seen["RNG restore"] += len(mine["rng"])
        seen["unscaled float16 step"] += any(r["float16"] is not None for r in rows)
        counts = [*seen.items(), ("GradScaler step", self.float16.compared)]
        said = [f"{n} {what}{'s' if n != 1 else ''}" for what, n in counts if n]
        if said:
            self.report.note("results", f"compared across ranks: {', '.join(said)}")

    def _destroy(self, original: Any) -> Any:
        def destroy_process_group(group: Any = None) -> Any:
            world = group is None or group is dist.GroupMember.WORLD
            if self.active and world and sys.exc_info()[0] is None and dist.is_initialized():
                self.at_end()
            return original(group)

        return destroy_process_group
