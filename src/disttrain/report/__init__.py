"""`disttrain report RUN_DIR`: a PNG of a run (loss, throughput, per-rank step time,
restarts and world-size changes) and a summary table. Imports no torch.

    run_data.py        reads metrics.jsonl, run_events.jsonl and the sample audit
    figure.py          draws the picture (matplotlib, Agg)
    report_command.py  the command: arguments, the JSON sidecar, the summary table
"""

from disttrain.report.report_command import main, report
from disttrain.report.run_data import Mark, RunData, load_run

__all__ = ["Mark", "RunData", "load_run", "main", "report"]
