"""Fast recovery soak (issue 13), a command, not a test:

    python bench/goodput_soak.py [--events 100] [--steps 1200] [--out FILE] [--seed 0] [--strategy ddp|fsdp]

One long run of the tiny job with `[elastic] fast_recovery = true` (200 ms of delay
per step, a disk checkpoint every 50 steps) takes `--events` random events, 1-4 s
apart: kill -9 of a training process (60 %), kill -9 of a waiting spare (25 %), or
kill -9 of both ranks' training processes 0.1 s apart (15 %; when both die before the
state is handed over, the disk checkpoint is the source). The run must then end
bit-identical to an uninterrupted run of the same steps, every sample of each complete
epoch exactly once, with no torchrun restart. Appends its section to --out (default
bench/results/recovery_fast.md, recovery_fast_fsdp.md under `--strategy fsdp`, where a
newcomer's shard comes from its buddy's memory). Exit status 1 when a check fails.
Not covered here: the loss of a whole agent and scale-down / scale-up, which take
torchrun's restart path (bench/recovery_bench.py times them).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import torch  # noqa: E402

from bench.common import machine  # noqa: E402
from bench.goodput_bench import FAST, STRATEGY, Run, _children, _start_ticks, exactly_once  # noqa: E402


def spares(run: Run) -> list[int]:
    """Each slot supervisor's newer child."""
    out = []
    for sup in _children(run.proc.pid):
        kids = sorted(_children(sup), key=_start_ticks)
        if len(kids) > 1:
            out.append(kids[-1])
    return out


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def soak(tmp: Path, events: int, steps: int, rng: random.Random) -> dict:
    ref = Run(tmp, "ref", [f"--train.steps={steps}"], fault=None)
    run = Run(tmp, "soak", FAST + [f"--train.steps={steps}"])
    done = {"worker": 0, "spare": 0, "both": 0}
    try:
        run.wait_step(5, 240)
        while sum(done.values()) < events and run.proc.poll() is None:
            time.sleep(rng.uniform(1.0, 4.0))
            kind = rng.choices(["worker", "spare", "both"], weights=[60, 25, 15])[0]
            workers = run.training_processes()
            if kind == "worker" and workers:
                kill([rng.choice(workers)])
            elif kind == "spare" and spares(run):
                kill([rng.choice(spares(run))])
            elif kind == "both" and len(workers) == 2:
                kill(workers[:1])
                time.sleep(0.1)
                kill(workers[1:])
            else:
                continue
            done[kind] += 1
        code = run.proc.wait(timeout=3600)
    finally:
        if run.proc.poll() is None:
            run.stop()
    if ref.proc.wait(timeout=1800) != 0:
        raise RuntimeError(ref.log.read_text()[-3000:])
    a = torch.load(ref.out / "model.pt", weights_only=True) if (ref.out / "model.pt").exists() else {}
    b = torch.load(run.out / "model.pt", weights_only=True) if (run.out / "model.pt").exists() else {}
    same = bool(a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    epochs, problems = exactly_once(run)
    text = run.log.read_text(errors="replace")
    return {
        "events": done,
        "exit": code,
        "same": same,
        "epochs": epochs,
        "problems": problems,
        "promotions": run.promotions(),
        "restarts": text.count("will restart worker group"),
        "from_disk": text.count("no rank holds the state in memory") + text.count("no step has every shard in memory"),
        "last_step": run.last_step(),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--out", default=None, help="default bench/results/recovery_fast[_fsdp].md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--keep", help="run in this folder and keep it (logs, audit) instead of a temporary one")
    a = ap.parse_args(argv)
    STRATEGY[:] = [f"--parallel.strategy={a.strategy}"]
    a.out = a.out or str(ROOT / f"bench/results/recovery_fast{'_fsdp' if a.strategy == 'fsdp' else ''}.md")
    m, t0 = machine(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        if a.keep:
            Path(a.keep).mkdir(parents=True, exist_ok=True)
        r = soak(Path(a.keep or d), a.events, a.steps, random.Random(a.seed))
    ok = r["exit"] == 0 and r["same"] and not r["problems"] and r["restarts"] == 0
    e = r["events"]
    section = (
        f"\n### Soak ({a.strategy}): {sum(e.values())} random events over one run\n\n"
        f"Command: `python bench/goodput_soak.py {' '.join(argv)}`".rstrip()
        + "  \n"
        f"{m['date']}, 1-minute load {m['load_1min']} at the start, {os.getloadavg()[0]:.2f} at the end; "
        f"{time.monotonic() - t0:.0f} s.\n\n"
        f"Events: {e['worker']} kill -9 of a training process, {e['spare']} of a waiting spare, "
        f"{e['both']} of both ranks 0.1 s apart. Spares promoted: {r['promotions']}; torchrun "
        f"restarts: {r['restarts']}; recoveries that had to read the disk checkpoint (every holder "
        f"of the state died): {r['from_disk']}. The run ended at step {r['last_step']} with "
        f"exit status {r['exit']}; final model {'bit-identical to' if r['same'] else '**differs from**'} "
        f"the uninterrupted run's; {r['epochs']} complete epoch(s) audited: "
        f"{'zero duplicated and zero dropped samples' if not r['problems'] else '; '.join(r['problems'])}. "
        f"Verdict: {'passed' if ok else '**failed**'}.\n"
    )
    with open(a.out, "a") as f:
        f.write(section)
    print(section)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
