"""The report picture: loss, throughput and per-rank step time over optimizer steps,
with a vertical mark at every restart and world-size change (matplotlib, Agg).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Literal, TypedDict

from disttrain.report.run_data import RunData, numbers


class _Style(TypedDict):
    """The keywords of a mark's line (matplotlib's Line2D / axvline)."""

    color: str
    linestyle: Literal["--", "-."]
    linewidth: float


# One style per kind of mark, the same in every panel and in the legend.
MARK_STYLE: dict[str, _Style] = {
    "restart": _Style(color="#d62728", linestyle="--", linewidth=1.6),
    "world_size": _Style(color="#7b2cbf", linestyle="-.", linewidth=1.6),
}
MARK_NAME = {"restart": "restart (resumed from checkpoint)", "world_size": "world-size change"}


MAX_LABELS = 40
"""The most marks labelled in the picture: a run of thousands of restarts draws every
line but labels only the first ones (the summary table counts them all)."""


def _panel_marks(ax, data: RunData) -> None:
    """One vertical line per mark, all of one kind drawn as one collection: drawing
    and laying out stay linear in the number of marks."""
    for kind, style in MARK_STYLE.items():
        steps = [m.step for m in data.marks if m.kind == kind]
        if steps:
            ax.vlines(
                steps,
                0,
                1,
                transform=ax.get_xaxis_transform(),
                colors=style["color"],
                linestyles=style["linestyle"],
                linewidths=style["linewidth"],
                alpha=0.85,
                zorder=1,
            )


def _label_marks(ax, data: RunData) -> None:
    """The label of each of the first `MAX_LABELS` marks at the top of the panel, right
    of its line; labels of marks at one step are stacked."""
    stacked: dict[int, int] = {}
    for m in data.marks[:MAX_LABELS]:
        row = stacked.get(m.step, 0)
        stacked[m.step] = row + 1
        ax.annotate(
            m.label,
            xy=(m.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12 - 14 * row),
            textcoords="offset points",
            fontsize=9,
            color=MARK_STYLE[m.kind]["color"],
            va="top",
            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.8),
        )


def _loss(ax, data: RunData) -> None:
    if data.superseded:
        x, y = data.series("loss", data.superseded)
        ax.plot(x, y, "x", color="0.45", markersize=5, label="train, killed attempt (trained again)")
    x, y = data.series("loss")
    ax.plot(x, y, color="#1f77b4", linewidth=1.4, label="train")
    x, y = data.series("heldout_loss")
    if x:
        ax.plot(x, y, "o-", color="#ff7f0e", linewidth=1.4, markersize=5, label="held-out")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Loss", loc="left", fontsize=11, fontweight="bold")


def _throughput(ax, data: RunData) -> None:
    key = "tokens_per_s" if data.series("tokens_per_s")[0] else "samples_per_s"
    x, y = data.series(key)
    ax.plot(x, [v / 1000 for v in y], color="#2ca02c", linewidth=1.2, label=key.replace("_per_s", "/s"))
    ax.set_ylabel(("tokens" if key == "tokens_per_s" else "samples") + " per second (thousands)")
    ax.set_title("Throughput (all ranks) and world size", loc="left", fontsize=11, fontweight="bold")
    wx, wy = data.series("world_size")
    if wx:
        twin = ax.twinx()
        twin.step(wx, wy, where="post", color="0.35", linewidth=1.2, label="world size (ranks)")
        twin.set_ylabel("ranks")
        twin.set_ylim(0, max(wy) + 1)
        twin.yaxis.get_major_locator().set_params(integer=True)
        twin.legend(loc="lower right", fontsize=9)


def _step_time(ax, data: RunData) -> None:
    rows = [(r["step"], [t * 1000 for t in times]) for r in data.records if (times := numbers(r.get("step_time_s")))]
    ax.set_title("Step time per rank (wall time per optimizer step)", loc="left", fontsize=11, fontweight="bold")
    ax.set_ylabel("milliseconds")
    if not rows:
        ax.text(0.5, 0.5, "no per-rank step times in metrics.jsonl", transform=ax.transAxes, ha="center", color="0.4")
        return
    x = [s for s, _ in rows]
    ax.fill_between(
        x,
        [min(t) for _, t in rows],
        [max(t) for _, t in rows],
        step="mid",
        color="#9467bd",
        alpha=0.3,
        label="fastest to slowest rank",
    )
    ax.plot(
        x,
        [statistics.median(t) for _, t in rows],
        color="#9467bd",
        linewidth=1.2,
        drawstyle="steps-mid",
        label="median rank",
    )
    # Clip the axis at a high percentile: evaluation and checkpoint windows are spikes that
    # would flatten every other step.
    tops = sorted(max(t) for _, t in rows)
    ax.set_ylim(0, tops[int(0.95 * (len(tops) - 1))] * 1.6)


def render(data: RunData, png: str | Path) -> Path:
    """Draw `data` into `png` (created or replaced). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True, constrained_layout=True)
    for ax, draw in zip(axes, (_loss, _throughput, _step_time), strict=False):
        draw(ax, data)
        _panel_marks(ax, data)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=9)
    _label_marks(axes[0], data)
    handles, labels = axes[0].get_legend_handles_labels()
    for kind in sorted({m.kind for m in data.marks}):
        handles.append(Line2D([], [], **MARK_STYLE[kind]))
        labels.append(MARK_NAME[kind])
    axes[0].legend(handles, labels, loc="center right", fontsize=9, framealpha=0.9)
    axes[1].legend(loc="upper left", fontsize=9)
    axes[2].legend(loc="upper left", fontsize=9)
    axes[2].set_xlabel("optimizer step")
    restarts = sum(m.kind == "restart" for m in data.marks)
    fig.suptitle(
        f"disttrain run {data.run_dir.name}: {data.records[-1]['step']} steps, "
        f"{data.attempts} attempt(s), {restarts} restart(s)",
        fontsize=13,
    )
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
