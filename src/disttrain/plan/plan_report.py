"""Showing a `Plan`: a rich table for people, JSON for machines, a stacked-bar PNG.

matplotlib is imported only when a PNG is asked for, with the Agg backend so that it
works on a headless node and never opens a window.
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.errors import UserError
from disttrain.plan.memory import fmt_bytes
from disttrain.plan.planner import FITS, NO_FIT, Plan, StrategyEstimate
from disttrain.plan.tp import tp_traffic

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


def _table(heading: str, rows: list[StrategyEstimate], mark: str | None, comm: str = "comm/step"):
    """A rich table of `rows`, the one whose key is `mark` starred and bold."""
    from rich.table import Table

    offload = any(s.host for s in rows)
    table = Table(title=heading, title_justify="left", header_style="bold")
    table.add_column("strategy")
    for col in ("params", "grads", "optim", "activations", "buffers", "total"):
        table.add_column(col, justify="right")
    table.add_column("fit")
    table.add_column(comm, justify="right")
    if offload:
        table.add_column("host", justify="right")
    colour = {FITS: "green", NO_FIT: "red"}
    for s in rows:
        star = " *" if s.key == mark else ""
        cells = [
            f"{s.label}{star}",
            *(fmt_bytes(getattr(s, p)) for p in PARTS),
            fmt_bytes(s.total),
            f"[{colour.get(s.fit, 'yellow')}]{s.fit}[/]",
            _comm_cell(s) if s.tp > 1 else fmt_bytes(s.comm_bytes),
        ]
        if offload:
            cells.append(fmt_bytes(s.host) if s.host else "-")
        table.add_row(*cells, style="bold" if star else None)
    return table


def _comm_cell(row: StrategyEstimate) -> str:
    inside, across = tp_traffic(row.comm_parts)
    return f"{fmt_bytes(inside)} + {fmt_bytes(across)}"


def print_table(plan: Plan, console=None) -> None:
    """The table, the recommendation with its reason, the LR advice, the tensor-parallel
    degrees with theirs, and the notes."""
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # pipes get 80 columns by default: too narrow to read
            console = Console(width=160)
    console.print(_table(title(plan), plan.strategies, plan.recommended))
    rec = plan.get(plan.recommended).label if plan.recommended else "none"
    console.print(f"[bold]Recommendation:[/] {rec} - {plan.reason}", highlight=False)
    for line in plan.lr.lines():
        console.print(f"  {line}", highlight=False)
    notes = list(plan.notes)
    if plan.tp_rows:
        mark = f"tp{plan.tp_recommended}" if plan.tp_recommended else None
        heading = "Tensor parallel x FSDP full: tp ranks split each layer, dp ranks shard the rest"
        console.print(_table(heading, plan.tp_rows, mark, comm="comm/step (tp + dp)"))
        notes.append(
            "TP rows: --batch is each TP group's batch; comm = the activation all-reduces inside a "
            "TP group (one node's links) + FSDP's over the dp ranks."
        )
    rec_tp = f"tp {plan.tp_recommended}" if plan.tp_recommended else "none"
    console.print(f"[bold]Tensor parallel:[/] {rec_tp} - {plan.tp_reason}", highlight=False)
    if plan.tp is not None:
        asked = plan.get_tp(plan.tp)
        console.print(f"  asked for tp {plan.tp}: {asked.fit}, {fmt_bytes(asked.total)} per device", highlight=False)
    for note in notes + [
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
