"""A killed FSDP rank's take-over, with and without the spares' rehearsal of their first step.

    python bench/spare_rehearsal_bench.py             # 2 rounds; bench/results/recovery_rehearsal.md
    python bench/spare_rehearsal_bench.py --rounds 1

Each round runs the same job twice, `[elastic] rehearse_spares` on, then off: 2 ranks
under `disttrain run`, FSDP, `[elastic] fast_recovery = true`, the tiny GPT of the
recovery benchmarks, 150 ms injected per step, and 4 kill -9 of a training process in
its backward (ranks 1, 0, 1, 0 at steps 20, 45, 70, 95: 25 steps apart, so each
replacement spare has stood by long enough to rehearse). Timed from the sample audit's
`time_ns`: what each killed step took more than the run's median step. Both sides do
the same work; the ratio of their medians comes from the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/spare_rehearsal_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import base_env, machine
from bench.recovery_job import ROOT, TINY

KILL_STEPS = (20, 45, 70, 95)
STEPS = 110
DELAY_MS = 150
FIXED = ("--train.steps", "--checkpoint.every", "--train.batch_size")


def fault() -> str:
    kills = [f"kill@backward:rank={k % 2 ^ 1},step={s},restart={k}" for k, s in enumerate(KILL_STEPS)]
    return ";".join([*kills, f"delay@step:ms={DELAY_MS}"])


def one_run(out: Path, rehearse: bool) -> list[float]:
    """The job once; each killed step's time over the median step (s)."""
    cmd = [sys.executable, "-m", "disttrain.cli", "run", "--nproc", "2", "-m", "disttrain.train"]
    cmd += [str(ROOT / "examples/tiny_gpt.toml"), *[a for a in TINY if not a.startswith(FIXED)]]
    cmd += [f"--train.steps={STEPS}", "--checkpoint.every=50", "--train.batch_size=2", "--train.accum_steps=2"]
    cmd += ["--parallel.strategy=fsdp", "--elastic.fast_recovery=true", f"--train.out_dir={out}"]
    cmd += [f"--elastic.rehearse_spares={'true' if rehearse else 'false'}"]
    env = {**base_env(threads=1), "DISTTRAIN_FAULT": fault(), "DISTTRAIN_JOB_SECRET": "5a" * 32}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the job exited {proc.returncode}: {proc.stderr[-600:]}")
    ends: dict[int, int] = {}
    for f in (out / "samples").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                ends[r["step"]] = max(ends.get(r["step"], 0), r["time_ns"])
    steps = sorted(ends)
    step_s = statistics.median((ends[b] - ends[a]) / 1e9 for a, b in zip(steps, steps[1:], strict=False))
    return [(ends[s] - ends[s - 1]) / 1e9 - step_s for s in KILL_STEPS]


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "n/a"


def render(runs: dict[bool, list[float]], argv: list[str], took: float, load: tuple[float, float]) -> str:
    m = machine()
    on, off = runs[True], runs[False]
    ratio = statistics.median(on) / statistics.median(off) if on and off else float("nan")
    lines = [
        "## Fast recovery under FSDP: a killed rank's spare, with and without its rehearsal",
        "",
        f"Command: `{shlex.join(['python', 'bench/spare_rehearsal_bench.py', *argv])}`  ",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; {m['date']}; "
        f"1-minute load {load[0]:.2f} at the start, {load[1]:.2f} at the end (a shared machine). "
        f"The run took {took:.0f} s.",
        "",
        f"2 ranks, FSDP, {DELAY_MS} ms injected per step, 4 kill -9 of a training process per job "
        f"(steps {', '.join(map(str, KILL_STEPS))}); the jobs alternate, rehearsal on, then off.",
        "",
        "| `elastic.rehearse_spares` | kills | killed step's time over a step (s), median (min-max) |",
        "|---|---:|---|",
        f"| true | {len(on)} | {cell(on)} |",
        f"| false | {len(off)} | {cell(off)} |",
        "",
        f"On / off: **{ratio:.2f}** of the take-over's cost. A promoted spare without the rehearsal works out "
        "torch's sharding plan of each DTensor operator of its first clip and optimizer step "
        "(`train/spare_rehearsal.py`), while the survivor waits for it.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python bench/spare_rehearsal_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/recovery_rehearsal.md")
    a = ap.parse_args(argv)
    runs: dict[bool, list[float]] = {True: [], False: []}
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as tmp:
        for k in range(a.rounds):
            for rehearse in (True, False):
                runs[rehearse] += one_run(Path(tmp) / f"{k}-{rehearse}", rehearse)
                print(rehearse, runs[rehearse][-len(KILL_STEPS) :], flush=True)
    a.out.write_text(render(runs, argv, time.monotonic() - t0, (load0, os.getloadavg()[0])))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
