"""The GPT-2 124M shape through `disttrain train` on 2 CPU ranks: step time with
compile off and on (ddp, fsdp), peak memory per rank against `disttrain plan`, and
the size of the checkpoint it writes.

    python bench/gpt2_bench.py [--steps 6] [--block 1024] [--strategies ddp,fsdp]

Token files come from `disttrain data prepare` over the standard library's top-level
.py files (bytes), as examples/gpt2_124m.toml describes. Each cell is one launch of
`disttrain train examples/gpt2_124m.toml` with `--steps` optimizer steps of one
sequence per rank; the step time is the median of the slowest rank's step after the
first two (which include compiling). Writes bench/results/gpt2.md (merged into
BENCHMARKS.md by `python -m bench --report-only`). Not part of the test suite: on a
2-core machine one cell takes minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "gpt2_124m.toml"


def disttrain(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "disttrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"disttrain {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def prepare_tokens(out: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    disttrain("data", "prepare", *map(str, sorted(stdlib.glob("*.py"))), "--out", str(out), "--quiet")
    return out


def run_cell(tokens: Path, out: Path, strategy: str, compile: bool, steps: int, block: int) -> dict:
    """One launch; returns median step time, peak memory per rank, checkpoint bytes, wall."""
    start = time.monotonic()
    disttrain("train", str(CONFIG), f"--data.tokens={tokens}", f"--parallel.strategy={strategy}",
              f"--train.compile={str(compile).lower()}", f"--train.steps={steps}", "--train.batch_size=1",
              "--train.accum_steps=1", f"--model.block_size={block}", "--train.eval_every=0",
              "--train.eval_batches=1", "--train.log_every=1", f"--checkpoint.every={steps}",
              f"--train.out_dir={out}")
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["step_time_max_s"] for r in rows if r["step"] > 2] or [rows[-1]["step_time_max_s"]]
    ckpt = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file()) \
        if (out / "checkpoints").exists() else 0
    return {"step_s": statistics.median(steady), "first_step_s": rows[0]["step_time_max_s"],
            "peak_mb": max(max(r["peak_mem_mb"]) for r in rows), "ckpt_bytes": ckpt, "wall_s": wall}


def planned_mb(strategy: str, block: int) -> float:
    """`disttrain plan`'s per-rank total for the example's shape with checkpointing."""
    proc = disttrain("plan", "--gpt", str(CONFIG), "--devices", "2", "--batch", "1", "--seq-len", str(block),
                     "--accum-steps", "1", "--format", "json", timeout=300)
    plans = {s["key"]: s for s in json.loads(proc.stdout)["strategies"]}
    base = "fsdp_full" if strategy == "fsdp" else strategy  # the example's sharding
    return plans[f"{base}+ac"]["total"] / 2**20


def render(cells: dict, args: argparse.Namespace, command: str) -> str:
    lines = ["## GPT-2 124M on 2 CPU ranks (disttrain train, token files)", "",
             f"`{command}`: {args.steps} steps of 1 x {args.block} tokens per rank, activation "
             f"checkpointing on as in examples/gpt2_124m.toml. Step: median of the slowest rank "
             f"after step 2.", "",
             "| strategy | compile | step (s) | first step (s) | compiled / eager | peak RSS per rank (MB) "
             "| plan (MB) | checkpoint (GB) |", "|---|---|---|---|---|---|---|---|"]
    for (strategy, compile), c in cells.items():
        eager = cells.get((strategy, False))
        ratio = f"{c['step_s'] / eager['step_s']:.2f}" if compile and eager else "-"
        lines.append(f"| {strategy} | {'on' if compile else 'off'} | {c['step_s']:.2f} | {c['first_step_s']:.1f} "
                     f"| {ratio} | {c['peak_mb']:.0f} | {c['plan_mb']:.0f} | {c['ckpt_bytes'] / 1e9:.2f} |")
    lines += ["", "Peak RSS counts the whole process (the Python and torch libraries too), the plan "
              "only the training state and activations.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--block", type=int, default=1024, help="tokens per sequence (GPT-2: 1024)")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--compile", default="off,on", help="off, on, or off,on")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "gpt2.md"))
    args = ap.parse_args(argv)
    command = "python bench/gpt2_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cells: dict = {}
    with tempfile.TemporaryDirectory(prefix="gpt2_bench_") as tmp:
        tokens = prepare_tokens(Path(tmp) / "tokens")
        for strategy in args.strategies.split(","):
            for flag in args.compile.split(","):
                compile = flag == "on"
                cell = run_cell(tokens, Path(tmp) / f"{strategy}_{flag}", strategy, compile, args.steps, args.block)
                cell["plan_mb"] = planned_mb(strategy, args.block)
                cells[(strategy, compile)] = cell
                print(strategy, flag, json.dumps(cell), flush=True)
    Path(args.results).write_text(render(cells, args, command.strip()))
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
