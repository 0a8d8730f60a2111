"""A number printed on rank 0 that is rank 0's shard only: a validation loss or accuracy
each rank computed over its own part of the data, printed as if it were the whole.

What is seen, with public names only:
- an **evaluation**: a model called (at the top level) with gradients off or in
  `eval()` mode, through the root calls of `model_watch`. It lasts until the next
  training forward. Its first forward's inputs are fingerprinted (data.fingerprint; the
  output when the inputs hold no tensor, as for `model(**batch)`).
- **collectives** that combine values across ranks (`all_reduce`, `all_gather`,
  `reduce`, `gather`, their `_object` and tensor forms, `reduce_scatter`, `all_to_all`),
  wrapped in `torch.distributed`; `broadcast` and `barrier` are not (they do not make a
  number global).
- rank 0's **prints**: `print` and `logging` records (not disttrain's own) whose text
  holds a decimal number (`0.42`, `3e-4`, `87%`, `nan`), during an evaluation.

The verdict (`judge`), on every rank's evaluations gathered at a checked step: the
ranks' evaluations had different inputs (each rank evaluated its own shard), and no
combining collective ran between the evaluation's start and rank 0's last print in it:
the printed value is rank 0's part. A warning, worded softly: rank 0's shard may be
what the script means. A training loss printed on rank 0 is not an evaluation (a
training forward ran just before it) and is never flagged.
"""

from __future__ import annotations

import builtins
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from disttrain.check.data import fingerprint
from disttrain.check.patches import Patches
from disttrain.check.verdicts import Finding, user_line
from disttrain.runtime.log import current_rank

COMBINING = (
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "all_gather_object",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)
"""The `torch.distributed` collectives after which a number may be global."""
NUMBER = re.compile(r"\d\.\d|\d[eE][-+]?\d|\d\s?%|\bnan\b|\binf\b", re.IGNORECASE)
"""A decimal number in a printed line (an epoch or step count alone is no metric)."""
MAX_EVALS = 8
"""Evaluations kept per rank between two exchanges, the newest (a frozen model in eval
mode, called at every micro-batch, is one each time)."""


@dataclass
class Evaluation:
    """One evaluation on this rank: the optimizer steps taken before it, its first
    forward's line and fingerprint, whether a combining collective ran since it began,
    and rank 0's last numeric print in it (line, text, whether a collective ran before
    that print)."""

    after_step: int
    line: str | None
    first: tuple[float, float]
    combined: bool = False
    printed: tuple[str | None, str, bool] | None = None


class NumberWatch:
    """This rank's evaluations since the last exchange (`take`), judged across ranks."""

    def __init__(self, own_group: Any, steps: Any) -> None:
        self.own_group, self.steps = own_group, steps
        """Callables: the checks' own process group (its collectives are not the
        script's), and the optimizer steps taken so far."""
        self.current: Evaluation | None = None
        self.done: list[Evaluation] = []
        self.active = False
        self._patches = Patches()

    def install(self) -> None:
        self.active = True
        for name in COMBINING:
            self._patches.wrap(dist, name, self._collective)
        self._patches.wrap(builtins, "print", self._print)
        self._patches.wrap(logging.Logger, "handle", self._handle)

    def remove(self) -> None:
        self.active = False
        self._patches.restore()

    def root_call(self, module: nn.Module, args: Any, output: Any) -> None:
        """A model called at the top level (model_watch): a training forward ends an
        evaluation; a forward without gradients or in eval mode starts one."""
        if torch.is_grad_enabled() and module.training:
            self._end()
        elif self.current is None:
            first = fingerprint(args)
            if first == (0.0, 0.0):
                first = fingerprint(output)
            self.current = Evaluation(self.steps(), user_line(), first)

    def pending(self) -> bool:
        return bool(self.done) or self.current is not None

    def take(self) -> list[dict]:
        """This rank's evaluations since the last call, as plain values for the exchange."""
        self._end()
        taken, self.done = self.done, []
        return [{"after_step": e.after_step, "line": e.line, "first": e.first, "printed": e.printed} for e in taken]

    def _end(self) -> None:
        if self.current is not None:
            self.done = [*self.done[1 - MAX_EVALS :], self.current]
            self.current = None

    def _collective(self, original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if self.active and self.current is not None and (group is None or group is not self.own_group()):
                self.current.combined = True
            return original(*args, **kwargs)

        return collective

    def _print(self, original: Any) -> Any:
        def print_(*args: Any, **kwargs: Any) -> Any:
            if self.active and self.current is not None:
                self._printed(lambda: (kwargs.get("sep") or " ").join(str(a) for a in args))
            return original(*args, **kwargs)

        return print_

    def _handle(self, original: Any) -> Any:
        def handle(logger: logging.Logger, record: logging.LogRecord) -> Any:
            if self.active and self.current is not None and not record.name.startswith("disttrain"):
                self._printed(record.getMessage)
            return original(logger, record)

        return handle

    def _printed(self, text: Any) -> None:
        """Rank 0 printed during an evaluation: its newest numeric line is kept."""
        assert self.current is not None
        if current_rank() != 0:
            return
        try:
            shown = str(text())
        except Exception:  # noqa: BLE001  (a record whose arguments do not format: the script's own error, later)
            return
        if NUMBER.search(shown):
            self.current.printed = (user_line(), shown.strip()[:100], self.current.combined)


def judge(rows: list[list[dict]]) -> list[tuple[str, Finding]]:
    """Every rank's `take()` at the same exchange: a warning for an evaluation whose
    inputs differ across ranks, printed on rank 0 with no combining collective before
    the print (see the module)."""
    if len(rows) < 2 or len({len(r) for r in rows}) != 1:
        return []  # an evaluation on some ranks only (rank 0 alone evaluating the whole set)
    for i, mine in enumerate(rows[0]):
        sharded = any(tuple(r[i]["first"]) != tuple(mine["first"]) for r in rows[1:])
        printed = mine["printed"]  # the ranks run the same collectives: rank 0's order is theirs
        if sharded and printed is not None and not printed[2]:
            return [("numbers", Finding("numbers", False, _shard_text(mine, len(rows))))]
    return []


def _shard_text(evaluation: dict, world: int) -> str:
    where, text = evaluation["printed"][:2]
    line = evaluation["line"]
    return (
        f'the number printed on rank 0{f" at {where}" if where else ""} ("{text}") is rank 0\'s '
        f"shard only: the {world} ranks evaluated different batches (the evaluation after step "
        f"{evaluation['after_step']}, its forward{f' at {line}' if line else ''}) and no all_reduce or all_gather ran "
        f"between it and the print, so it covers 1/{world} of the data, not all of it. If it is "
        "meant as the global value: sum the metric and the count on each rank, all_reduce both "
        "(t = torch.tensor([total, count]); dist.all_reduce(t)), then divide (t[0] / t[1]) and "
        "print that."
    )
