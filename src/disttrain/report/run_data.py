"""A run directory read back as plain data: the metrics on the final timeline and the
steps where the run restarted or changed its world size.

Reads what `disttrain train` (and `dt.Job`) write under `train.out_dir`:
`metrics.jsonl` (one record per log step), `run_events.jsonl` (one line per attempt)
and, when `elastic.record_samples` was on, the sample audit `samples/*.jsonl`. No torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disttrain import json_text
from disttrain.errors import UserError
from disttrain.jsonl import read_jsonl, read_text


@dataclass(frozen=True)
class Mark:
    """A vertical mark: at `step` the run restarted (`kind` "restart") or continued on
    another number of ranks (`kind` "world_size")."""

    step: int
    kind: str
    label: str


@dataclass
class RunData:
    """`records`: the last record of each step, in step order (a step trained again after
    a restart replaces the killed attempt's); `superseded`: the replaced ones; `marks` in
    step order; `source`: the file the marks came from."""

    run_dir: Path
    records: list[dict]
    superseded: list[dict] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    attempts: int = 1
    source: str = "metrics.jsonl"
    skipped: list[int] = field(default_factory=list)
    """Line numbers of metrics.jsonl that are not metrics records (not JSON, not an
    object, no whole step >= 0, or nothing but the step): left out, and reported."""

    def series(self, key: str, records: list[dict] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that hold a number under `key`."""
        pairs = [
            (r["step"], value)
            for r in (self.records if records is None else records)
            if (value := number(r.get(key))) is not None
        ]  # drops NaN, infinities and what is not a number
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def marks_json(self) -> list[dict]:
        return [asdict(m) for m in self.marks]


def load_run(run_dir: str | Path) -> RunData:
    """Read `run_dir`. Raises `UserError` (one line, with the fix) when the directory
    does not exist or holds no metrics records."""
    run = Path(run_dir)
    if run.exists() and not run.is_dir():
        raise UserError(
            f"{str(run)!r} is a file, not a run directory. Pass the train.out_dir of a "
            f"run (the folder that holds metrics.jsonl)."
        )
    if not run.is_dir():
        raise UserError(
            f"run directory {str(run)!r} does not exist. Pass the train.out_dir of a "
            f"run (the folder that holds metrics.jsonl)."
        )
    path = run / "metrics.jsonl"
    raw, skipped, lines = _metrics(path)
    if not raw:
        what = (
            f"a metrics.jsonl with no metrics record in its {lines} line(s)"
            if lines
            else "an empty metrics.jsonl"
            if path.is_file()
            else "no metrics.jsonl"
        )
        raise UserError(
            f"{str(run)!r} has {what}, so there is nothing to draw. Pass the "
            f"train.out_dir of a run that reached its first log step (train.log_every)."
        )
    latest: dict[int, dict] = {}
    superseded = []
    for r in raw:  # file order is time order: a later record of a step replaces the earlier
        if r["step"] in latest:
            superseded.append(latest[r["step"]])
        latest[r["step"]] = r
    data = RunData(run, [latest[s] for s in sorted(latest)], superseded, skipped=skipped)
    for source, find in (
        ("run_events.jsonl", _from_events),
        ("samples/", _from_audit),
        ("metrics.jsonl", _from_metrics),
    ):
        found = find(run, raw)
        if found is not None:
            data.marks, data.attempts = found
            data.source = source
            break
    return data


def _is_record(item) -> bool:
    step = item.get("step") if isinstance(item, dict) else None
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and any(k != "step" for k in item)


def _metrics(path: Path) -> tuple[list[dict], list[int], int]:
    """(records, line numbers that are not records, non-blank lines) of metrics.jsonl."""
    try:
        text = read_text(path) or ""  # a FIFO, a symlink or a file over the bound: one line
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}.") from None
    records, skipped, lines = [], [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        try:
            item = json_text.loads(line)
        except ValueError:
            item = None
        if _is_record(item):
            records.append(item)
        else:
            skipped.append(number)
    return records, skipped, lines


def number(value) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return f if math.isfinite(f) else None


def numbers(value) -> list[float] | None:
    """`value` as floats when it is a non-empty list of finite numbers, else None."""
    if not isinstance(value, list) or not value:
        return None
    floats = [f for f in map(number, value) if f is not None]
    return floats if len(floats) == len(value) else None


def whole(value, default: int = 0) -> int:
    """`value` when it is a whole number (not a bool), else `default`: a run file's
    field that holds a string, a float or a list is read as missing."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _marks(starts: list[tuple[int, int, int]]) -> list[Mark]:
    """Marks from (attempt, step, world size) of each attempt's start, in time order."""
    marks = []
    for (_, _, before), (attempt, step, world) in zip(starts, starts[1:], strict=False):
        marks.append(Mark(step, "restart", f"restart {attempt}: resumed at step {step}"))
        if world != before:
            marks.append(Mark(step, "world_size", f"world size {before} -> {world}"))
    return sorted(marks, key=lambda m: (m.step, m.kind))


def _from_events(run: Path, raw: list[dict]):
    path = run / "run_events.jsonl"
    events = [e for e in read_jsonl(path) if {"step", "world_size"} <= e.keys()]
    if not events:
        return None
    return _marks([(i, whole(e["step"]), whole(e["world_size"], 1)) for i, e in enumerate(events)]), len(events)


def _from_audit(run: Path, raw: list[dict]):
    """Each attempt of an audited run has its own generation: its first step - 1 is the
    step it resumed from."""
    files = sorted((run / "samples").glob("*.jsonl")) if (run / "samples").is_dir() else []
    first: dict[int, tuple[int, int]] = {}  # generation -> (first step, world)
    for rec in (r for f in files for r in read_jsonl(f)):
        g, s = rec.get("generation"), rec.get("step")
        if isinstance(g, int) and isinstance(s, int) and (g not in first or s < first[g][0]):
            first[g] = (s, whole(rec.get("world")))
    if not first:
        return None
    gens = sorted(first)
    return _marks([(i, first[g][0] - 1, first[g][1]) for i, g in enumerate(gens)]), len(gens)


def _from_metrics(run: Path, raw: list[dict]):
    """Without events or audit: a new "attempt" value, or a step that goes back, starts
    an attempt; it resumed from the step before its first record."""
    starts: list[tuple[int, int, int]] = []
    prev = None
    for r in raw:
        key = r.get("attempt", prev[0] if prev else 0)  # a record without one keeps the attempt
        if prev is None or key != prev[0] or r["step"] <= prev[1]:
            starts.append((len(starts), r["step"] - 1 if starts else 0, whole(r.get("world_size"), 1)))
        prev = (key, r["step"])
    return _marks(starts), len(starts)
