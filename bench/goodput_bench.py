"""Fast recovery benchmark (issue 13): `[elastic] fast_recovery = true` under kill -9.

    python bench/goodput_bench.py [--quick] [--out FILE] [--kills 8] [--pairs 3] [--strategy ddp|fsdp]
                                  [--buddy-every N]
                                  [--minutes 10] [--every-s 60] [--steps-minutes 3] [--every-steps 20]

The tiny job of the elastic tests (bench/recovery_job.py's TINY: 1-layer GPT, gloo,
2 CPU ranks, standalone torchrun), 200 ms of injected delay per step, a disk checkpoint
every 50 steps; `--strategy fsdp` shards it (each rank's shard also in its buddy's CPU
memory, `elastic.buddy_copy`, every `--buddy-every` steps). Writes a markdown section to --out (default
bench/results/recovery_fast.md, recovery_fast_fsdp.md under fsdp):
(a) kill -9 of a random training process at a random point of a step -> the next step
    committed by every rank, and the steps redone (completed steps done again);
(b) the step-time cost of the machinery with nothing failing: interleaved runs without
    and with fast_recovery (no injected delay), median step interval of each;
(c) goodput: one long run with a kill -9 of a random rank every --every-s seconds for
    --minutes, and one with a kill every --every-steps steps. Goodput = committed steps
    x the undisturbed step time / wall time; kills survived; every sample of each
    complete epoch exactly once (the sample audit's final timeline).
Times come from the sample audit's `time_ns` (written when a rank commits a step).
Targets are reported, not asserted; the exit status is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from bench.common import base_env, fmt, machine, summary  # noqa: E402
from bench.recovery_job import EPOCH_STEPS, TINY  # noqa: E402
from disttrain.elastic import final_timeline  # noqa: E402

FAST = ["--elastic.fast_recovery=true", "--checkpoint.every=50"]
SLOW = "delay@step:ms=200"
SPARE_WARM_S = 12.0
"""Between the kills of (a): a new spare's imports take 3-5 s here (more under load); a
kill before it is warm waits for the rest of them."""
TARGETS = {"kill": 1.0, "redone": 1, "goodput": 0.95, "cost": 0.02}
STRATEGY = ["--parallel.strategy=ddp"]
"""Given to every run of the benchmark (set by --strategy)."""


class Run:
    """One `disttrain run` of the tiny job in its own folder and session."""

    def __init__(self, tmp: Path, name: str, extra: list[str], fault: str | None = SLOW):
        self.out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
        extra = [*STRATEGY, *extra]
        self.log = self.out / "log.txt"
        env = base_env(threads=1)
        if fault:
            env["DISTTRAIN_FAULT"] = fault
        cmd = [
            sys.executable,
            "-m",
            "disttrain.cli",
            "run",
            "--nproc",
            "2",
            "-m",
            "disttrain.train",
            "examples/tiny_gpt.toml",
            *TINY,
            "--checkpoint.every=50",
            *extra,
            f"--train.out_dir={self.out}",
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def records(self) -> list[dict]:
        out = []
        for f in (self.out / "samples").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line being written
                    pass
        return out

    def commits(self) -> dict[int, int]:
        """step -> ns when the last rank committed it, on the final timeline."""
        records = self.records()
        latest: dict[int, int] = {}
        for r in records:
            latest[r["step"]] = max(latest.get(r["step"], -1), r["generation"])
        times: dict[int, int] = {}
        for r in records:
            if r["generation"] == latest[r["step"]]:
                times[r["step"]] = max(times.get(r["step"], 0), r["time_ns"])
        return times

    def last_step(self) -> int:
        return max((r["step"] for r in self.records()), default=0)

    def wait_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.last_step() < step:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no step {step} in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def training_processes(self) -> list[int]:
        """Each slot supervisor's older child (the newer one is its spare)."""
        out = []
        for sup in _children(self.proc.pid):
            kids = sorted(_children(sup), key=_start_ticks)
            if kids:
                out.append(kids[0])
        return out

    def stop(self) -> None:
        """SIGTERM to the training processes (a preemption: save, exit 0), then the rest."""
        for pid in self.training_processes():
            _signal(pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def promotions(self) -> int:
        return self.log.read_text(errors="replace").count("its warm spare took over")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _start_ticks(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_one(run: Run, rng: random.Random) -> tuple[int, int]:
    """kill -9 a random training process at a random point of a step; (ns, last step before)."""
    time.sleep(rng.uniform(0, 0.25))
    victim = rng.choice(run.training_processes())
    before = run.last_step()
    t = time.time_ns()
    os.kill(victim, signal.SIGKILL)
    return t, before


def after_kill(run: Run, t_kill: int, before: int, timeout: float = 60) -> tuple[float, int]:
    """(seconds from the kill to the next step every rank committed, completed steps redone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        later = {s: t for s, t in run.commits().items() if t > t_kill}
        if later:
            first = min(later, key=lambda s: later[s])
            return (later[first] - t_kill) / 1e9, max(0, before - (first - 1))
        time.sleep(0.02)
    raise RuntimeError(f"no step after the kill in {timeout:.0f} s:\n{run.log.read_text()[-3000:]}")


def step_time(run: Run, skip: int = 10) -> float:
    """The median gap between consecutive commits after step `skip`."""
    times = sorted(t for s, t in run.commits().items() if s > skip)
    gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def exactly_once(run: Run) -> tuple[int, list[str]]:
    """(complete epochs checked, problems) on the final timeline."""
    timeline = final_timeline(run.records())
    problems, epochs = [], 0
    top = max(timeline, default=0)
    missing = [s for s in range(1, top + 1) if s not in timeline]
    if missing:
        problems.append(f"steps missing from the audit: {missing[:5]}")
    for e in range(top // EPOCH_STEPS):
        counts = Counter(i for s in range(e * EPOCH_STEPS + 1, (e + 1) * EPOCH_STEPS + 1) for i in timeline.get(s, []))
        epochs += 1
        if len(counts) != EPOCH_STEPS * 8 or set(counts.values()) != {1}:
            dup = sum(1 for c in counts.values() if c > 1)
            problems.append(f"epoch {e}: {EPOCH_STEPS * 8 - len(counts)} samples missing, {dup} repeated")
    return epochs, problems


def bench_kills(tmp: Path, kills: int, rng: random.Random) -> dict:
    run = Run(tmp, "kills", FAST + ["--train.steps=100000"])
    out: dict[str, Any] = {"recovery": [], "redone": []}
    try:
        run.wait_step(8, 180)
        for _ in range(kills):
            t, before = kill_one(run, rng)
            rec, redone = after_kill(run, t, before)
            out["recovery"].append(rec)
            out["redone"].append(redone)
            time.sleep(SPARE_WARM_S)  # the replaced spare imports torch meanwhile
        out["step_s"] = step_time(run)
    finally:
        run.stop()
    out["promotions"], out["restarts"] = run.promotions(), run.log.read_text().count("will restart worker group")
    out["epochs"], out["problems"] = exactly_once(run)
    return out


def bench_cost(tmp: Path, pairs: int, steps: int) -> dict:
    """Interleaved A/B: the same job without and with fast_recovery, no injected delay."""
    off: list[float] = []
    on: list[float] = []
    for _ in range(pairs):
        for flags, into in (([], off), (FAST, on)):
            run = Run(tmp, "ab", [*flags, f"--train.steps={steps}"], fault=None)
            if run.proc.wait(timeout=600) != 0:
                raise RuntimeError(run.log.read_text()[-3000:])
            into.append(step_time(run, skip=steps // 3))  # after the spares' imports
    return {"off": off, "on": on, "ratio": [b / a - 1 for a, b in zip(off, on, strict=False)]}


def bench_goodput(
    tmp: Path, minutes: float, rng: random.Random, every_s: float | None, every_steps: int | None
) -> dict:
    run = Run(tmp, "goodput", FAST + ["--train.steps=1000000"])
    kills, recovery, redone = 0, [], []
    try:
        run.wait_step(2, 180)
        t0 = time.monotonic()
        next_kill = t0 + every_s if every_s else None
        mark = run.last_step()
        while time.monotonic() - t0 < minutes * 60:
            due = (next_kill is not None and time.monotonic() >= next_kill) or (
                every_steps and run.last_step() >= mark + every_steps
            )
            if due:
                t, before = kill_one(run, rng)
                kills += 1
                rec, red = after_kill(run, t, before)
                recovery.append(rec)
                redone.append(red)
                mark = run.last_step()
                next_kill = time.monotonic() + every_s if every_s else None
            time.sleep(0.05)
    finally:
        run.stop()
    commits = run.commits()
    times = sorted(commits.values())
    wall = (times[-1] - times[0]) / 1e9
    # The undisturbed step time: the median gap between consecutive commits.
    base = statistics.median((b - a) / 1e9 for a, b in zip(times, times[1:], strict=False))
    useful = (len(times) - 1) * base
    epochs, problems = exactly_once(run)
    return {
        "minutes": minutes,
        "kills": kills,
        "promotions": run.promotions(),
        "steps": len(times),
        "wall_s": wall,
        "step_s": base,
        "goodput": useful / wall,
        "recovery": recovery,
        "redone": redone,
        "epochs": epochs,
        "problems": problems,
        "restarts": run.log.read_text().count("will restart worker group"),
    }


def _label() -> str:
    """'ddp', or 'fsdp, buddy copy every N steps'."""
    opts = dict(a.lstrip("-").split("=") for a in STRATEGY)
    strategy = opts["parallel.strategy"]
    return strategy if strategy == "ddp" else f"{strategy}, buddy copy every {opts['elastic.buddy_every']} step(s)"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def render(m: dict, k: dict, c: dict, g: list[dict], argv: list[str], took: float, load_end: float) -> str:
    rec, red = summary(k["recovery"]), summary(k["redone"])
    cost = summary(c["ratio"])
    lines = [
        f"## Fast recovery: warm spares and in-memory state, {_label()} (issue 13)",
        "",
        f"Command: `{' '.join(['python bench/goodput_bench.py', *argv])}`  ",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; {m['date']}; "
        f"1-minute load {m['load_1min']} at the start, {load_end:.2f} at the end (a load near or above "
        f"the core count means other work ran alongside: times are then pessimistic and spread). "
        f"The run took {took:.0f} s.",
        "",
        "The tiny job of the elastic tests (1-layer GPT, gloo, CPU, 2 ranks, standalone), "
        "`[elastic] fast_recovery = true`, 200 ms of injected delay per step, a disk checkpoint "
        "every 50 steps. Times are read from the sample audit (`time_ns` of each rank's commit). "
        f"Median (min-max). Kills of (a) are {SPARE_WARM_S:g} s apart, so each finds a warm spare; "
        "the A/B runs have no injected delay and are timed after their first third (the spares "
        "import torch alongside the first steps).",
        "",
        "| figure | measured | goal | verdict |",
        "|---|---|---|---|",
        f"| kill -9 of one worker -> next step committed by every rank ({len(k['recovery'])} kills) | "
        f"{fmt(rec, digits=2, unit=' s')} | <= 1.0 s | {verdict(bool(rec) and rec['median'] <= TARGETS['kill'])} |",
        f"| completed steps redone after that kill (the step in flight is redone too) | "
        f"{fmt(red, digits=0)} | <= 1 | {verdict(bool(red) and red['max'] <= TARGETS['redone'])} |",
        f"| step-time cost with nothing failing ({len(c['ratio'])} interleaved pairs) | "
        f"{fmt(cost, scale=100, digits=1, unit=' %')} | <= 2 % | "
        f"{verdict(bool(cost) and cost['median'] <= TARGETS['cost'])} |",
    ]
    for r in g:
        what = f"one kill every {r['every']}"
        lines.append(
            f"| goodput, {what}, {r['minutes']:g} min | {100 * r['goodput']:.1f} % "
            f"({r['kills']} kills, {r['steps']} steps) | >= 95 % | "
            f"{verdict(r['goodput'] >= TARGETS['goodput'])} |"
        )
    lines += [
        "",
        f"Kill run: {k['promotions']} promotions, {k['restarts']} torchrun restarts, undisturbed "
        f"step {k['step_s']:.3f} s (so a recovery costs the time above minus about one step); "
        f"{k['epochs']} complete epoch(s) audited: "
        f"{'every sample exactly once' if not k['problems'] else '; '.join(k['problems'])}.",
        "",
        f"Step time without / with the machinery (s): {', '.join(f'{a:.4f}' for a in c['off'])} / "
        f"{', '.join(f'{b:.4f}' for b in c['on'])}.",
        "",
    ]
    if g:
        lines += [
            "| goodput run | kills | survived (spare promoted) | torchrun restarts | kill -> next step (s) "
            "| steps redone | epochs audited | samples |",
            "|---|---:|---:|---:|---|---|---:|---|",
        ]
        for r in g:
            lines.append(
                f"| every {r['every']} | {r['kills']} | {r['promotions']} | {r['restarts']} | "
                f"{fmt(summary(r['recovery']), digits=2)} | {fmt(summary(r['redone']), digits=0)} | "
                f"{r['epochs']} | {'exactly once' if not r['problems'] else '; '.join(r['problems'])} |"
            )
        lines += [
            "",
            "Goodput counts every slowdown against the undisturbed (median) step, the "
            "shared machine's load included, not only the recoveries.",
        ]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer kills, 1 pair, 2 + 1 minutes of goodput")
    ap.add_argument("--out", default=None, help="default bench/results/recovery_fast[_fsdp].md")
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--buddy-every", type=int, default=1, help="[elastic] buddy_every under fsdp")
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--ab-steps", type=int, default=1500)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("--steps-minutes", type=float, default=3.0)
    ap.add_argument("--every-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.quick:
        a.kills, a.pairs, a.minutes, a.steps_minutes = 4, 1, 2.0, 1.0
    STRATEGY[:] = [f"--parallel.strategy={a.strategy}", f"--elastic.buddy_every={a.buddy_every}"]
    a.out = a.out or str(ROOT / f"bench/results/recovery_fast{'_fsdp' if a.strategy == 'fsdp' else ''}.md")
    rng, m, t0 = random.Random(a.seed), machine(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="goodput-") as d:
        tmp = Path(d)
        k = bench_kills(tmp, a.kills, rng)
        c = bench_cost(tmp, a.pairs, a.ab_steps)
        g = []
        if a.minutes > 0:
            g.append({**bench_goodput(tmp, a.minutes, rng, a.every_s, None), "every": f"{a.every_s:g} s"})
        if a.steps_minutes > 0:
            g.append(
                {**bench_goodput(tmp, a.steps_minutes, rng, None, a.every_steps), "every": f"{a.every_steps} steps"}
            )
    text = render(m, k, c, g, argv, time.monotonic() - t0, os.getloadavg()[0])
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
