"""One rank of `disttrain train` (what torchrun starts: `python -m disttrain.train`),
on train_spec's job, for the product A/B. Not a user script.

The clocks are read where the trainer writes its log line (every rank calls
`JsonlWriter.write`; rank 0 writes): the writer is replaced by a subclass that also
notes (wall, CPU) time per step, the only change to the trainer's run, outside it.
"""

import json
import os
from pathlib import Path

from disttrain.config import load_config
from disttrain.train import trainer
from train_spec import CONFIG, clocks, overrides, result

LOG_TIMES: dict[int, tuple[float, float]] = {}


class ClockedWriter(trainer.JsonlWriter):
    def write(self, record: dict) -> None:
        LOG_TIMES[record["step"]] = clocks()
        super().write(record)


def main() -> None:
    cfg = load_config(CONFIG, overrides())
    trainer.JsonlWriter = ClockedWriter
    summary = trainer.train(cfg, config_dir=CONFIG.parent)
    rank = int(os.environ.get("RANK", "0"))
    out = result(rank, summary["world_size"], LOG_TIMES, cfg.train.batch_size * cfg.model.block_size)
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
