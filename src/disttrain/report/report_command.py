"""`disttrain report RUN_DIR [--out PNG]`: the picture, its JSON sidecar and a table."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from disttrain.config.paths import PNG_SIGNATURE, has_prefix, output_file
from disttrain.errors import UserError
from disttrain.report.figure import render
from disttrain.report.run_data import RunData, load_run, number, numbers, whole


def report(run_dir: str | Path, out: str | Path | None = None) -> dict:
    """Render `run_dir` to `out` (default RUN_DIR/report.png) and write the sidecar
    `out` with suffix .json: {"png", "steps", "attempts", "marks": [{"step", "kind",
    "label"}], "marks_from"}. Returns the sidecar's dict. Raises `UserError` for a
    missing directory or one without metrics."""
    data = load_run(run_dir)
    target = Path(out) if out else data.run_dir / "report.png"
    # before drawing: never overwrite what is not an earlier report (a PNG, its sidecar)
    output_file(target, "--out", replaceable=has_prefix(PNG_SIGNATURE))
    output_file(target.with_suffix(".json"), "--out's sidecar", replaceable=_is_sidecar)
    try:
        png = render(data, target)
        side = {
            "png": str(png),
            "steps": data.records[-1]["step"],
            "attempts": data.attempts,
            "marks": data.marks_json(),
            "marks_from": data.source,
            "skipped_lines": data.skipped,
        }
        png.with_suffix(".json").write_text(json.dumps(side, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the report {target}: {e.strerror or e}.") from None
    side["table"] = summary_rows(data)
    return side


def _is_sidecar(path: Path) -> bool:
    """True for the .json a report wrote beside its PNG (it may be replaced)."""
    try:
        side = json.loads(path.read_text())
        return isinstance(side, dict) and {"png", "marks"} <= side.keys()
    except (OSError, ValueError):
        return False


def _last(data: RunData, key: str) -> str:
    _, y = data.series(key)
    return f"{y[-1]:.3f}" if y else "-"


def summary_rows(data: RunData) -> list[tuple[str, str]]:
    """(what, value) rows of the terminal summary."""
    rows = [
        ("optimizer steps", str(data.records[-1]["step"])),
        ("final train loss", _last(data, "loss")),
        ("final held-out loss", _last(data, "heldout_loss")),
    ]
    key = "tokens_per_s" if data.series("tokens_per_s")[0] else "samples_per_s"
    by_world: dict[int, list[float]] = {}
    for r in data.records:
        if (value := number(r.get(key))) is not None:
            by_world.setdefault(whole(r.get("world_size"), 1), []).append(value)
    for world, values in sorted(by_world.items()):
        rows.append((f"{key.replace('_per_s', '/s')} on {world} rank(s), median", f"{statistics.median(values):,.0f}"))
    pairs = ((number(r.get("step_time_max_s")), number(r.get("step_time_min_s"))) for r in data.records)
    spread = [(high, low) for high, low in pairs if high is not None and low is not None]
    if spread:
        rows.append(
            (
                "step time, slowest / fastest rank (median)",
                f"{statistics.median(s for s, _ in spread) * 1000:.1f} / "
                f"{statistics.median(f for _, f in spread) * 1000:.1f} ms",
            )
        )
    memory = [mem for r in data.records if (mem := numbers(r.get("peak_mem_mb")))]
    if memory:
        rows.append(("peak memory per rank (last record)", ", ".join(f"{m:,.0f}" for m in memory[-1]) + " MiB"))
    restarts = [m for m in data.marks if m.kind == "restart"]
    rows.append(
        (
            "attempts / restarts",
            f"{data.attempts} / {len(restarts)}"
            + (f" (at step{'s' * (len(restarts) > 1)} {', '.join(str(m.step) for m in restarts)})" if restarts else ""),
        )
    )
    for m in data.marks:
        if m.kind == "world_size":
            rows.append(("world-size change", f"step {m.step}: {m.label}"))
    if data.skipped:
        shown = ", ".join(map(str, data.skipped[:5])) + (", ..." if len(data.skipped) > 5 else "")
        rows.append(("metrics.jsonl lines skipped (not records)", f"{len(data.skipped)}: line(s) {shown}"))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disttrain report",
        description="Draw a run: loss, throughput, per-rank step time, restarts and world-size changes.",
    )
    parser.add_argument("run_dir", help="the run's train.out_dir (holds metrics.jsonl)")
    parser.add_argument(
        "--out",
        help="the PNG to write (default RUN_DIR/report.png); a .json sidecar with the marks is written next to it",
    )
    args = parser.parse_args(argv)
    if args.out and not args.out.endswith(".png"):
        raise UserError(f"--out {args.out!r} must name a .png file, for example --out report.png.")
    side = report(args.run_dir, args.out)
    table = Table(title=f"disttrain report: {args.run_dir}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for what, value in side["table"]:
        table.add_row(what, value)
    table.add_row("picture", side["png"])
    Console().print(table)
    return 0
