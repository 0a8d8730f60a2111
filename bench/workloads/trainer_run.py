"""One rank of `disttrain train` (what torchrun starts: `python -m disttrain.train`),
on train_spec's job, for the product A/B. Not a user script.

The clocks are read where the trainer writes its log line (every rank calls
`JsonlWriter.write` for metrics.jsonl; rank 0 writes): that method is wrapped for the
run to also note (wall, CPU) time per step, the only change to the trainer's run,
outside it. (It is patched on the class: the step loop binds the name at its import.)
"""

import json
import os
from pathlib import Path
from unittest import mock

from train_spec import CONFIG, clocks, overrides, result

from disttrain import JsonlWriter
from disttrain.config import load_config
from disttrain.train import trainer

LOG_TIMES: dict[int, tuple[float, float]] = {}
_WRITE = JsonlWriter.write


def _clocked_write(self: JsonlWriter, record: dict) -> None:
    if self.path.name == "metrics.jsonl":  # the step's log line, not run events
        LOG_TIMES[record["step"]] = clocks()
    _WRITE(self, record)


def main() -> None:
    cfg = load_config(CONFIG, overrides())
    with mock.patch.object(JsonlWriter, "write", _clocked_write):
        summary = trainer.train(cfg, config_dir=CONFIG.parent)
    rank = int(os.environ.get("RANK", "0"))
    out = result(rank, summary["world_size"], LOG_TIMES, cfg.train.batch_size * cfg.model.block_size)
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
