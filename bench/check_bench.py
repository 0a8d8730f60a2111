"""What `disttrain run --check` costs: the same DDP script (workloads/torch_ddp.py, the
benchmark's tiny GPT, 2 gloo ranks, one thread each) under three launchers, launched in
turn in each repeat so every ratio compares runs minutes apart at most:

- `torchrun`: torch's launcher, nothing of disttrain in the ranks;
- `disttrain run`: checks off (the cost of having them: none, if the code is right);
- `disttrain run --check-steps W`: the first W optimizer steps checked, then none.

Each launch times 3W steps (rank 0's seconds per step, from workloads/harness.py). The
steps in the window (2..W; the first holds the checks' one-time set-up) and those after
it (from W+3: only the DataLoader wrapper and the optimizer hooks remain until the
epoch boundary, each returning at once) are compared with the same
steps of `disttrain run` without checks. Targets: off 1.00x (within noise), in the window
at most 2x, after it at most 1.03x.

    python bench/check_bench.py [--window 10] [--repeats 3] [--results bench/results/check.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench.common import base_env, machine  # noqa: E402

SCRIPT = BENCH / "workloads" / "torch_ddp.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
    "off": [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2"],
    "on": [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2", "--check-steps", "{window}"],
}


def launch(name: str, window: int, out: Path) -> list[float]:
    """Rank 0's seconds per step of one launch of SCRIPT under launcher `name`."""
    env = base_env(threads=1)
    env.update({"BENCH_OUT": str(out), "BENCH_STEPS": str(3 * window), "BENCH_WARMUP": "0"})
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "workloads"), env["PYTHONPATH"]])
    cmd = [a.format(window=window) for a in LAUNCHERS[name]] + [str(SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    if name == "on" and "disttrain --check: checked" not in proc.stderr:
        raise SystemExit(f"the checks did not run: {proc.stderr[-2000:]}")
    return json.loads((out / "rank0.json").read_text())["step_s"]


def ratio(mine: list[float], base: list[float]) -> float:
    return statistics.median(mine) / statistics.median(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", type=Path, default=BENCH / "results" / "check.md")
    args = ap.parse_args()
    w = args.window
    steps: dict[str, dict[str, list[float]]] = {n: {"window": [], "after": []} for n in LAUNCHERS}
    for repeat in range(args.repeats):
        order = list(LAUNCHERS)[repeat % 3 :] + list(LAUNCHERS)[: repeat % 3]
        for name in order:
            with tempfile.TemporaryDirectory(prefix="check-bench-") as tmp:
                times = launch(name, w, Path(tmp))
            # step_s[i] is the time from step i+1 to step i+2
            steps[name]["window"] += times[1 : w - 1]
            steps[name]["after"] += times[w + 2 :]
            print(f"[check] repeat {repeat + 1} {name}: median {statistics.median(times) * 1e3:.1f} ms/step")
    rows = [
        (
            "checks off: `disttrain run` / `torchrun`, every step",
            ratio(
                steps["off"]["after"] + steps["off"]["window"], steps["torchrun"]["after"] + steps["torchrun"]["window"]
            ),
            "1.00 (noise)",
        ),
        (f"checks on, steps 2-{w} (the window) / off", ratio(steps["on"]["window"], steps["off"]["window"]), "<= 2"),
        (
            f"checks on, steps {w + 3}-{3 * w} (after the window) / off",
            ratio(steps["on"]["after"], steps["off"]["after"]),
            "<= 1.03",
        ),
    ]
    m = machine()
    lines = [
        "# `disttrain run --check`: what it costs",
        "",
        f"`python bench/check_bench.py --window {w} --repeats {args.repeats}`; {m.get('cpu', '')}, "
        f"torch {m.get('torch', '')}; workloads/torch_ddp.py at 2 gloo ranks, rank 0's median seconds per step, "
        f"{args.repeats} interleaved launches per launcher.",
        "",
        "| ratio | measured | target |",
        "|---|---|---|",
        *(f"| {what} | {value:.3f} | {target} |" for what, value, target in rows),
        "",
        "| launcher | ms/step in the window | ms/step after it |",
        "|---|---|---|",
        *(
            f"| {n} | {statistics.median(s['window']) * 1e3:.1f} | {statistics.median(s['after']) * 1e3:.1f} |"
            for n, s in steps.items()
        ),
        "",
    ]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
