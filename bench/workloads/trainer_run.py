"""One rank of `disttrain train` (what torchrun starts: `python -m disttrain.train`),
on train_spec's job, for the product A/B. Not a user script.

The step clock is the trainer's own: rank 0's metrics.jsonl gives each log window's
tokens/s, hence its seconds, and the windows after step LOG_EVERY add up to the time
between that log line and the last one (train_spec.step_seconds). Every step ends in
collectives, so rank 0's clock is every rank's; the other ranks report only RSS.
"""

import json
import os
import resource
import time
from pathlib import Path

from train_spec import CONFIG, LOG_EVERY, STEPS, overrides

t0 = float(os.environ.get("BENCH_T0", time.time()))
from disttrain.config import load_config  # noqa: E402
from disttrain.train.trainer import train  # noqa: E402


def main() -> None:
    cfg = load_config(CONFIG, overrides())
    summary = train(cfg, config_dir=CONFIG.parent)
    rank = int(os.environ.get("RANK", "0"))
    result = {"rank": rank, "world": summary["world_size"], "step_s": [0.0], "first_step_s": 0.0,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "tokens_per_step": 0, "wall_s": time.time() - t0}
    if rank == 0:
        records = [json.loads(line) for line in Path(cfg.train.out_dir, "metrics.jsonl")
                   .read_text().splitlines()]
        tokens_per_step = cfg.train.batch_size * cfg.model.block_size * summary["world_size"]
        window = {r["step"]: (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]
                  for prev, r in zip([0] + [q["step"] for q in records], records)}
        timed = sum(s for step, s in window.items() if LOG_EVERY < step <= STEPS)
        result.update(step_s=[timed / (STEPS - LOG_EVERY)],
                      tokens_per_step=cfg.train.batch_size * cfg.model.block_size)
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
