"""A node joins a running job: the running ranks' pause, when the joined slots are admitted in memory.

    python bench/grow_bench.py               # 3 joins per strategy; bench/results/recovery_grow.md
    python bench/grow_bench.py --joins 1

Each join is a job of its own: 1 node x 2 ranks under `disttrain run --rdzv-backend
etcd`, `[elastic] fast_recovery = true`, global batch 8 (2 samples x 2 micro-batches a
rank), 150 ms injected per step. After its 4th step a second node of 2 slots starts
with the job's own command plus `--join`; it is admitted at a step boundary once its
warm spares are ready, and the job goes on at world 4. Timed from the sample audit's
`time_ns`: the running ranks' pause, the time from the last step committed at world 2 to
the first at world 4, less the median step of the run. The goal is at most one step's
time. Then both agents must end by themselves (exit 0) with the launcher's line that the
node was admitted, and every sample must be used once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # `python bench/grow_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import base_env, machine
from bench.node_loss_bench import audit, cell, failed_run, start, wait
from bench.recovery_job import ROOT, TINY, kill_tree

STEPS = 90
DELAY_MS = 150
SCALE_UP_S = 4.3
"""torchrun's scale-up on this machine (bench/results/recovery_scale.md): every worker restarts."""
LAST_LINE = "disttrain run: finished at world 4: slot(s)"


def trainer(out: Path, run_flags: list[str], strategy: str) -> list[str]:
    cmd = [sys.executable, "-m", "disttrain.cli", "run", *run_flags, "-m", "disttrain.train", "examples/tiny_gpt.toml"]
    cmd += [*TINY, f"--train.steps={STEPS}", f"--parallel.strategy={strategy}", "--elastic.fast_recovery=true"]
    return cmd + ["--train.batch_size=2", "--train.accum_steps=2", "--checkpoint.every=10", f"--train.out_dir={out}"]


def one_join(tmp: Path, strategy: str, endpoint: str, run_id: str) -> dict:
    out = tmp / run_id
    flags = ["--nnodes", "1", "--nproc", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint]
    cmd = trainer(out, [*flags, "--rdzv-id", run_id], strategy)
    env = {**base_env(threads=1), "DISTTRAIN_FAULT": f"delay@step:ms={DELAY_MS}", "DISTTRAIN_JOB_SECRET": "5a" * 32}
    logs = [tmp / f"{run_id}-job.txt", tmp / f"{run_id}-joiner.txt"]
    agents = [start(cmd, logs[0], env)]
    try:
        wait(lambda: any(r["step"] >= 4 for r in audit(out)), 120, "step 4", agents)
        agents.append(start(cmd[:4] + ["--join"] + cmd[4:], logs[1], env))
        rcs = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    records = audit(out)
    ends: dict[int, int] = {}
    for r in records:
        ends[r["step"]] = max(ends.get(r["step"], 0), r["time_ns"])
    world = {r["step"]: r["world"] for r in records}
    steps = sorted(ends)
    grown = next((s for s in steps if world[s] == 4), None)
    if grown is None:
        raise RuntimeError(f"never admitted: {logs[0].read_text()[-500:]}")
    step_s = statistics.median((ends[b] - ends[a]) / 1e9 for a, b in zip(steps, steps[1:], strict=False))
    gap = (ends[grown] - ends[grown - 1]) / 1e9
    last = [log.read_text().rstrip().splitlines()[-1] for log in logs]
    counts = Counter(i for r in records for i in r["indices"])
    return {
        "pause_s": gap - step_s,
        "gap_s": gap,
        "step_s": step_s,
        "admitted_after": grown - 1,
        "rcs": rcs,
        "lines": all(line.startswith(LAST_LINE) for line in last),
        "once": len(counts) == STEPS * 8 and max(counts.values()) == 1,
    }


def render(res: dict, argv: list[str], took: float, load_end: float) -> str:
    m = res["machine"]
    lines = [
        "## Fast recovery: a node joins a running job -> admitted in memory at a step boundary",
        "",
        f"Command: `{shlex.join(['python', 'bench/grow_bench.py', *argv])}`  ",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; {m['date']}; "
        f"1-minute load {m['load_1min']} at the start, {load_end:.2f} at the end (a shared machine). "
        f"The run took {took:.0f} s.",
        "",
        "| strategy | joins | pause (s): gap less one step | in steps | goal: <= 1 step | torchrun's scale-up | "
        "ended by themselves, every sample once |",
        "|---|---:|---|---|---|---|---|",
    ]
    for strategy, runs in res["runs"].items():
        done = [r for r in runs if "pause_s" in r]
        pauses = [r["pause_s"] for r in done]
        in_steps = [r["pause_s"] / r["step_s"] for r in done]
        met = pauses and statistics.median(in_steps) <= 1
        ok = sum(1 for r in done if r["rcs"] == [0, 0] and r["lines"] and r["once"])
        lines.append(
            f"| {strategy}, 1 x 2 -> 2 x 2 | {len(done)} | {cell(pauses)} | {cell(in_steps)} | "
            f"{'met' if met else '**missed**'} | {SCALE_UP_S} s, every worker restarted | {ok} of {len(runs)} |"
        )
    lines += ["", "| strategy | admitted after step | step (s) | gap (s) | pause (s) | exits |"]
    lines.append("|---|---|---|---|---|---|")
    for strategy, runs in res["runs"].items():
        for r in runs:
            if "error" in r:
                lines.append(f"| {strategy} | n/a | n/a | n/a | n/a | {r['error']} |")
                continue
            lines.append(
                f"| {strategy} | {r['admitted_after']} | {r['step_s']:.3f} | {r['gap_s']:.2f} | "
                f"{r['pause_s']:.2f} | {r['rcs']} |"
            )
    lines += [
        "",
        "The pause is a new generation: every rank leaves its process group at the step boundary, the "
        "groups are made again (on a store the new generation's rank 0 hosts) with the joined slots, "
        "the body (model, wrap) is built again at world 4 and the state comes from memory (DDP: a "
        "broadcast; FSDP: the buddy packs resharded). The joined node's start (its torchrun, imports, "
        "datasets) is not in it: its slots are admitted only once their warm spares are ready.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python bench/grow_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--joins", type=int, default=3, help="joins (jobs) per strategy")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/recovery_grow.md")
    a = ap.parse_args(argv)
    from disttrain.launch.etcd_server import EtcdServer

    t0, res = time.monotonic(), {"machine": machine(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="grow-") as tmp, EtcdServer().start() as server:
        for strategy in a.strategies.split(","):
            runs = res["runs"].setdefault(strategy, [])
            for k in range(a.joins):
                try:
                    runs.append(one_join(Path(tmp), strategy, server.endpoint, f"grow-{strategy}-{k}"))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    runs.append(failed_run(e))
                print(strategy, runs[-1], flush=True)
    a.out.write_text(render(res, argv, time.monotonic() - t0, os.getloadavg()[0]))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
