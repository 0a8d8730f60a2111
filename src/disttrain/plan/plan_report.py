"""Showing a `Plan`: a rich table for people, JSON for machines, a stacked-bar PNG.

matplotlib is imported only when a PNG is asked for, with the Agg backend so that it
works on a headless node and never opens a window.
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.errors import UserError
from disttrain.plan.memory import fmt_bytes
from disttrain.plan.planner import FITS, NO_FIT, Plan

PARTS = ("params", "grads", "optim", "activations", "buffers")
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def title(plan: Plan) -> str:
    w, m = plan.workload, plan.model
    where = f"{plan.nodes} x {plan.devices_per_node}" if plan.nodes > 1 else f"{plan.world}"
    return (
        f"{m.name}: {fmt_count(m.n_params)} params on {where} device(s) of "
        f"{fmt_bytes(plan.device_mem)} | {w.precision}, {w.optimizer}, batch "
        f"{w.batch_per_device} x seq {w.seq_len} per device, accum {w.accum_steps}"
    )


def print_table(plan: Plan, console=None) -> None:
    """The table, the recommendation with its reason, the LR advice and the notes."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # pipes get 80 columns by default: too narrow to read
            console = Console(width=160)
    offload = any(s.host for s in plan.strategies)
    table = Table(title=title(plan), title_justify="left", header_style="bold")
    table.add_column("strategy")
    for col in ("params", "grads", "optim", "activations", "buffers", "total"):
        table.add_column(col, justify="right")
    table.add_column("fit")
    table.add_column("comm/step", justify="right")
    if offload:
        table.add_column("host", justify="right")
    colour = {FITS: "green", NO_FIT: "red"}
    for s in plan.strategies:
        mark = " *" if s.key == plan.recommended else ""
        cells = [
            f"{s.label}{mark}",
            *(fmt_bytes(getattr(s, p)) for p in PARTS),
            fmt_bytes(s.total),
            f"[{colour.get(s.fit, 'yellow')}]{s.fit}[/]",
            fmt_bytes(s.comm_bytes),
        ]
        if offload:
            cells.append(fmt_bytes(s.host) if s.host else "-")
        table.add_row(*cells, style="bold" if mark else None)
    console.print(table)
    rec = plan.get(plan.recommended).label if plan.recommended else "none"
    console.print(f"[bold]Recommendation:[/] {rec} - {plan.reason}", highlight=False)
    for line in plan.lr.lines():
        console.print(f"  {line}", highlight=False)
    for note in plan.notes + [
        "memory per device (worst rank); comm = bytes each device sends per optimizer step "
        "(ring); not counted: CUDA context, allocator fragmentation, NCCL buffers."
    ]:
        console.print(f"  note: {note}", highlight=False, style="dim")


def to_json(plan: Plan) -> str:
    d = plan.to_dict()
    d["recommended_label"] = plan.get(plan.recommended).label if plan.recommended else None
    return json.dumps(d, indent=2)


def write_png(plan: Plan, path: str | Path) -> Path:
    """Stacked bars of the five parts per row, device memory and headroom lines; returns `path`."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"--png: folder {path.parent} does not exist. Create it or pick another path.")
    try:
        import matplotlib
    except ImportError:
        raise UserError("--png needs matplotlib: pip install matplotlib.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.strategies
    peak = max(r.total for r in rows)
    # Tiny models next to an 80 GiB line would be invisible: pick the unit from the bars and
    # leave the device line off the chart (named in the legend) when it dwarfs them.
    scale, unit = next(
        (d, u)
        for d, u in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
        if max(peak, 1) >= d
    )
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows) + 2), 5.5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part, color in zip(PARTS, COLORS, strict=False):
        vals = [getattr(r, part) / scale for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=False)]
    mem = plan.device_mem / scale
    show_mem = plan.device_mem <= 3 * peak
    top = max(max(bottom), mem if show_mem else 0) * 1.12
    if show_mem:
        ax.axhline(mem, color="black", linestyle="--", linewidth=1, label=f"device memory {fmt_bytes(plan.device_mem)}")
        ax.axhline(
            mem * (1 - plan.headroom), color="grey", linestyle=":", linewidth=1, label=f"{plan.headroom:.0%} headroom"
        )
    else:
        ax.plot([], [], " ", label=f"device memory {fmt_bytes(plan.device_mem)} (off scale)")
    for xi, r, b in zip(x, rows, bottom, strict=False):
        ax.text(
            xi,
            b + top * 0.01,
            "no fit" if r.fit == NO_FIT else fmt_bytes(r.total),
            ha="center",
            va="bottom",
            fontsize=7,
            color="red" if r.fit == NO_FIT else "black",
        )
    ax.set_xticks(x)
    ax.set_xticklabels(
        [r.label + (" *" if r.key == plan.recommended else "") for r in rows], rotation=35, ha="right", fontsize=8
    )
    for tick, r in zip(ax.get_xticklabels(), rows, strict=False):
        if r.key == plan.recommended:
            tick.set_fontweight("bold")
    ax.set_ylabel(f"{unit} per device")
    ax.set_ylim(0, top)
    ax.set_title(title(plan) + "\n* recommended", fontsize=8)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise UserError(f"cannot write --png {path}: {e.strerror or e}.") from None
    finally:
        plt.close(fig)
    return path
