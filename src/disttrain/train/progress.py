"""Terminal output of the trainer on rank 0: a progress bar and a summary table (rich)."""

from __future__ import annotations

import math


def _fmt(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


class TrainProgress:
    """A bar of optimizer steps showing global train loss, held-out loss and tokens/s
    (`unit` "sample" for a user's dataset).

    Disabled (a no-op) on ranks other than 0.
    """

    def __init__(self, total_steps: int, enabled: bool = True, start: int = 0, unit: str = "token"):
        self.enabled = enabled
        if not enabled:
            return
        # rich loads here, on rank 0 only: 0.1 s off every start (tests/launch/test_imports_startup.py)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("held-out {task.fields[heldout]}"),
            TextColumn("{task.fields[tok_s]} " + ("tok/s" if unit == "token" else "samples/s")),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=False),
            transient=False,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start, loss="-", heldout="-", tok_s="-"
        )
        self._progress.start()

    def advance(self, step: int) -> None:
        """Move the bar to `step`, every committed step; its figures come with `update`,
        at each metrics record (a loop that logs nothing has none)."""
        if self.enabled:
            self._progress.update(self._task, completed=step)

    def update(self, step: int, loss: float, heldout: float, tok_s: float) -> None:
        if self.enabled:
            self._progress.update(
                self._task, completed=step, loss=_fmt(loss), heldout=_fmt(heldout), tok_s=f"{tok_s:,.0f}"
            )

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()


def print_summary(summary: dict) -> None:
    """One table with the final train and held-out loss, steps, wall time, the model file
    (`run_summary.build`'s dict). Losses are labelled with the summary's `loss_unit`
    (nats/byte on the byte corpus, nats/token on token files), when it has one."""
    from rich.console import Console  # loaded at the end of a run, not at start-up
    from rich.table import Table

    tokens = "tokens_seen" in summary
    per = f" ({summary['loss_unit']})" if summary.get("loss_unit") else ""
    table = Table(title="disttrain: run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    seen = f"{summary['tokens_seen']:,} tokens" if tokens else f"{summary['samples_seen']:,} samples"
    wall = f"{summary['wall_time_s']:.1f} s"
    if summary.get("resumed"):  # a run of several attempts: the whole run, then this attempt
        wall += f" over all attempts ({summary['attempt_wall_time_s']:.1f} s this attempt)"
    rows = [
        ("strategy / world size", f"{summary['strategy']} x {summary['world_size']}"),
        ("optimizer steps", str(summary["steps"])),
        ("seen", seen),
        (f"held-out loss at start{per}", _fmt(summary["initial_heldout_loss"])),
        (f"final train loss{per}", _fmt(summary["final_train_loss"])),
        (f"final held-out loss{per}", _fmt(summary["final_heldout_loss"])),
        *(
            (k.replace("final_heldout_", "final held-out "), _fmt(v))
            for k, v in summary.items()
            if k.startswith("final_heldout_") and k != "final_heldout_loss"
        ),
        ("wall time", wall),
        ("model", summary["checkpoint"]),
    ]
    for what, value in rows:
        table.add_row(what, value)
    Console().print(table)
