"""Worker: many trainer cells in one launch (tests/launch/test_matrix.py).

    matrix_cells.py reference OUT CELL...   each cell trained uninterrupted, one after another
    matrix_cells.py killed OUT CELL...      under `disttrain run --max-restarts N`: cell i is
                                            killed (SIGKILL in step 3's backward, on rank 1, or
                                            rank 0 in a world of 1) in attempt i; attempt i+1
                                            resumes it from its step-2 checkpoint, finishes it,
                                            then starts cell i+1
    matrix_cells.py both OUT CELL...        the first attempt trains every cell uninterrupted
                                            (as `reference`), then the cells as `killed` do;
                                            a CELL written `=CELL` is trained as a reference only

Each cell is `disttrain.train.trainer.train(load_config(tiny_gpt.toml, overrides))`, the
function `disttrain train` runs on every rank. The process group is started once per
launch and kept across cells (starting one costs seconds); every other part of the
trainer runs per cell exactly as under the CLI. Every attempt that starts a cell appends
a line to OUT/MODE/CELL/attempts.
"""

import os
import sys
from pathlib import Path

from trainer_cells import CELLS

from disttrain import runtime
from disttrain.config import load_config
from disttrain.runtime import fault_injection, process_group
from disttrain.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
        "--model.dropout=0.1", "--data.max_bytes=30000", "--train.batch_size=4", "--train.steps=4",
        "--train.eval_every=3", "--train.eval_batches=1", "--train.log_every=1",
        "--checkpoint.every=2", "--checkpoint.keep_last=2", "--guard.divergence_every=2"]
KILL_STEP = 3


def run_cells(mode: str, out: Path, names: list[str], attempt: int) -> None:
    """Train each named cell under OUT/MODE (killed: cell i is killed in attempt i)."""
    by_name = {c.name: c for c in CELLS}
    for index, name in enumerate(names):
        cell_dir = out / mode / name
        if (cell_dir / "summary.json").exists():
            continue  # finished in an earlier attempt
        if runtime.rank_info().is_main:
            cell_dir.mkdir(parents=True, exist_ok=True)
            with (cell_dir / "attempts").open("a") as f:
                f.write(f"{attempt}\n")
        victim = 1 if runtime.rank_info().world_size > 1 else 0
        fault = f"kill@backward:rank={victim},step={KILL_STEP},restart={index}" if mode == "killed" else None
        fault_injection.set_faults(fault)
        cfg = load_config(ROOT / "examples" / "tiny_gpt.toml",
                          [*TINY, *by_name[name].overrides(), f"--train.out_dir={cell_dir}"])
        train(cfg)


def main(mode: str, out: Path, names: list[str]) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    real_shutdown = process_group.shutdown
    process_group.shutdown = lambda: None  # one group for every cell of this launch
    runtime.init()
    try:
        if mode in ("reference", "both"):
            run_cells("reference", out, [n.removeprefix("=") for n in names], attempt)
        if mode in ("killed", "both"):
            run_cells("killed", out, [n for n in names if not n.startswith("=")], attempt)
    finally:
        process_group.shutdown = real_shutdown
        runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
