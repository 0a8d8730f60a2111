"""Recovery benchmark (issue 5): how fast an elastic job gets back to training.

    python bench/recovery_bench.py [--quick] [--out FILE] [--kills 5] [--cycles 20] [--no-plain]

Runs the real trainer (`disttrain run ... -m disttrain.trainer examples/tiny_gpt.toml`,
the tiny job of the elastic tests, every step slowed by 200 ms so events land
mid-run, a checkpoint every 2 steps) and writes a markdown section (default
bench/results/recovery.md, or $BENCH_RESULTS/recovery.md under `python -m bench --others`):

(a) kill -9 of one worker -> first completed step after the resume, and the steps
    redone, median (min-max) of `--kills`, for a standalone job (`--max-restarts`)
    and for two agents on etcd (`--nnodes 1:2`);
(b) scale-down (kill one agent's whole process tree -> first step at world 1) and
    scale-up (start a new agent -> first step at world 2), c10d and etcd, with
    `disttrain run`'s defaults and with plain torchrun's (no rdzv-conf, the shared
    TCP store left on); a wait past its timeout is reported as "hung (> N s)";
(c) split brain: over `--cycles` scale-down/up cycles (half c10d, half etcd), no two
    worlds ever train at once, and the kept timeline uses each sample once per epoch.

Times come from the sample audit (`elastic.record_samples`): each attempt writes
samples/gen{G}-rank{r}.jsonl, G being rank 0's clock (ns) at the attempt's start,
and a step's time is its file's mtime when polled. Targets are reported, not asserted.
Exit status 0 unless a job could not start at all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # run as a script: make bench and disttrain importable

from bench.common import base_env, fmt, free_port, machine, summary  # noqa: E402
from disttrain.etcd_server import EtcdServer  # noqa: E402

# The tiny job of tests/elastic_helpers.py: 768 chunks, 96 steps of 8 samples per epoch.
TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
        "--model.dropout=0.1", "--data.max_bytes=24577", "--data.drop_last=true",
        "--train.batch_size=4", "--train.eval_every=0", "--train.eval_batches=1",
        "--train.log_every=1", "--optim.lr=0.01", "--checkpoint.keep_last=2",
        "--elastic.record_samples=true", "--train.steps=100000", "--checkpoint.every=2"]
EPOCH_STEPS = 96
SLOW = "delay@step:ms=200"
TARGETS = {"kill": 3.0, "down": 8.0, "up": 6.0}


class Hung(Exception):
    """A wait ran past its timeout (the job hung or died)."""


class Job:
    """Agents of one run sharing an output folder, and a poller of its sample audit."""

    def __init__(self, tmp: Path, name: str, plain: bool = False):
        self.out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
        self.plain, self.agents, self.logs = plain, [], []
        self.lines: dict[int, list[dict]] = {}  # generation -> its records
        self.first_poll: dict[int, int] = {}  # generation -> the poll that first saw it
        self._offsets: dict[Path, int] = {}
        self.polls = 0
        self.violations: list[str] = []

    def start_agent(self, flags: list[str]) -> subprocess.Popen:
        env = base_env(threads=1)
        env["DISTTRAIN_FAULT"] = SLOW
        if self.plain:  # plain torchrun: its own defaults, shared TCP store included
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
            launcher = [sys.executable, "-m", "torch.distributed.run"]
        else:
            launcher = [sys.executable, "-m", "disttrain.cli", "run"]
        log = self.out / f"agent{len(self.agents)}.txt"
        cmd = [*launcher, *flags, "-m", "disttrain.trainer", "examples/tiny_gpt.toml", *TINY,
               f"--train.out_dir={self.out}"]
        # Own session: the agent and its workers can be killed as one node.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.agents.append(proc)
        self.logs.append(log)
        return proc

    def poll(self) -> None:
        """Read new complete audit lines, newest generation first: an older generation's
        line first seen after a newer one started was written while the newer trained."""
        self.polls += 1
        files = sorted((self.out / "samples").glob("gen*-rank*.jsonl"),
                       key=lambda p: -int(p.name[3:].split("-")[0]))
        for f in files:
            try:
                mtime = f.stat().st_mtime_ns
                with f.open("rb") as fh:
                    fh.seek(self._offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[f] = self._offsets.get(f, 0) + end
            for line in data[:end].splitlines():
                r = json.loads(line)
                r["t"] = mtime  # exact for the last line read, an upper bound before it
                gen = r["generation"]
                self.first_poll.setdefault(gen, self.polls)
                newer = [g for g, p in self.first_poll.items() if g > gen and p < self.polls]
                if newer:
                    self.violations.append(f"generation {gen} wrote step {r['step']} "
                                           f"after generation {max(newer)} had started")
                self.lines.setdefault(gen, []).append(r)

    def records(self) -> list[dict]:
        return [r for lines in self.lines.values() for r in lines]

    def wait_first(self, after_ns: int, world: int | None, timeout: float, what: str) -> dict:
        """The first record of an attempt started after `after_ns` (at `world`, if given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            found = [r for r in self.records() if r["generation"] > after_ns
                     and (world is None or r["world"] == world)]
            if found:
                return min(found, key=lambda r: r["t"])
            if self.agents and all(a.poll() is not None for a in self.agents):
                raise Hung(f"every agent exited before {what}")
            time.sleep(0.05)
        raise Hung(f"hung (> {timeout:.0f} s)")

    def wait_steps(self, gen_after: int, n: int, timeout: float = 60) -> None:
        """Wait until attempts after `gen_after` have committed `n` steps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if len({r["step"] for r in self.records() if r["generation"] > gen_after}) >= n:
                return
            time.sleep(0.05)
        raise Hung(f"no progress in {timeout:.0f} s")

    def audit(self) -> list[str]:
        """Split-brain and exactly-once findings over everything recorded (empty: clean)."""
        problems = list(dict.fromkeys(self.violations))
        for gen, lines in self.lines.items():
            worlds = {r["world"] for r in lines}
            ranks = {r["rank"] for r in lines}
            if len(worlds) != 1 or len(ranks) > max(worlds):
                problems.append(f"generation {gen}: worlds {worlds}, ranks {ranks}")
        latest: dict[int, int] = {}  # the final timeline: per step, its newest attempt
        for r in self.records():
            latest[r["step"]] = max(latest.get(r["step"], -1), r["generation"])
        kept = sorted(s for s in latest if s < max(latest, default=0))  # the last may be half-recorded
        if kept and kept != list(range(1, kept[-1] + 1)):
            problems.append("the kept timeline has gaps in its steps")
        epochs: dict[int, list[int]] = {}
        for r in self.records():
            if r["step"] in kept and r["generation"] == latest[r["step"]]:
                epochs.setdefault((r["step"] - 1) // EPOCH_STEPS, []).extend(r["indices"])
        for e, idx in epochs.items():
            if len(idx) != len(set(idx)):
                problems.append(f"epoch {e}: {len(idx) - len(set(idx))} samples used twice")
        fenced = sum(p.read_text(errors="replace").count("StaleWriterError") for p in self.logs if p.exists())
        if fenced:
            problems.append(f"the checkpoint fence refused {fenced} stale writer(s)")
        return problems

    def stop(self) -> None:
        for a in self.agents:
            kill_tree(a.pid)
            try:
                a.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def descendants(pid: int) -> list[int]:
    return [d for c in children(pid) for d in (c, *descendants(c))]


def kill_tree(pid: int) -> None:
    """A node failure: the agent and every process under it (workers run in sessions of
    their own, so the agent's process group alone would leave them running)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def elastic_flags(backend: str, endpoint: str, plain: bool) -> list[str]:
    rdzv = "etcd-v2" if plain and backend == "etcd" else backend  # disttrain maps etcd -> etcd-v2
    return ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", rdzv, "--rdzv-endpoint",
            endpoint, "--rdzv-id", f"bench-{backend}", "--max-restarts", "100"]


def kill_workers(tmp: Path, backend: str, kills: int, rng: random.Random) -> dict:
    """(a): kill -9 one worker `kills` times; recovery seconds and steps redone."""
    job, server = Job(tmp, f"kill-{backend}"), None
    times, redone, worlds = [], [], []
    try:
        if backend == "standalone":
            job.start_agent(["--nproc", "2", "--max-restarts", "100"])
        else:
            server = EtcdServer().start()
            for _ in range(2):
                job.start_agent(elastic_flags("etcd", server.endpoint, plain=False))
        job.wait_first(0, 2, 120, "the first step")
        job.wait_steps(0, 4)
        for _ in range(kills):
            time.sleep(rng.uniform(0, 0.25))  # land at a random point of a step
            workers = [w for a in job.agents if a.poll() is None for w in children(a.pid)]
            victim = rng.choice(workers)
            before = max(r["step"] for r in job.records())
            t_kill = time.time_ns()
            os.kill(victim, signal.SIGKILL)
            first = job.wait_first(t_kill, None, 90, "the resumed step")
            job.poll()
            done = max(r["step"] for r in job.records() if r["generation"] < t_kill)
            times.append((first["t"] - t_kill) / 1e9)
            redone.append(max(done, before) - (first["step"] - 1))
            worlds.append(first["world"])
            job.wait_steps(t_kill, 3)
        return {"recovery": times, "redone": redone, "worlds": worlds, "problems": job.audit()}
    except Hung as e:
        return {"recovery": times, "redone": redone, "worlds": worlds, "error": str(e)}
    finally:
        job.stop()
        if server:
            server.stop()


def scale_cycles(tmp: Path, backend: str, cycles: int, plain: bool, timeouts: tuple[float, float]) -> dict:
    """(b), (c): kill one agent's node and start a new one, `cycles` times. c10d loses
    the newest agent (the first hosts the store, a single point of failure); etcd loses
    the oldest, so the first agent dies too."""
    job = Job(tmp, f"scale-{backend}-{'plain' if plain else 'disttrain'}", plain=plain)
    server = EtcdServer().start() if backend == "etcd" else None
    endpoint = server.endpoint if server else f"127.0.0.1:{free_port()}"
    down, up, result, phase = [], [], {}, "start"
    try:
        job.start_agent(elastic_flags(backend, endpoint, plain))
        time.sleep(1.0)  # the first agent hosts the c10d store
        job.start_agent(elastic_flags(backend, endpoint, plain))
        job.wait_first(0, 2, 120, "world 2")
        job.wait_steps(0, 3)
        for _ in range(cycles):
            alive = [a for a in job.agents if a.poll() is None]
            victim = alive[-1] if backend == "c10d" else alive[0]
            t_kill, phase = time.time_ns(), "scale-down"
            kill_tree(victim.pid)
            first = job.wait_first(t_kill, 1, timeouts[0], "world 1")
            down.append((first["t"] - t_kill) / 1e9)
            t_start, phase = time.time_ns(), "scale-up"
            job.start_agent(elastic_flags(backend, endpoint, plain))
            first = job.wait_first(t_start, 2, timeouts[1], "world 2")
            up.append((first["t"] - t_start) / 1e9)
            phase = "training at world 2"
            job.wait_steps(t_start, 2)
    except Hung as e:
        result["error"] = f"{phase}: {e}"
    finally:
        job.stop()
        if server:
            server.stop()
    return {**result, "down": down, "up": up, "problems": job.audit()}


def _cell(values: list[float], error: str | None, which: str, digits: int = 2) -> str:
    if values:
        return fmt(summary(values), digits=digits) + (f"; then {error.split(': ', 1)[1]}"
                                                      if error and error.startswith(which) else "")
    return error.split(": ", 1)[1] if error and error.startswith(which) else "n/a"


def verdict(values: list[float], target: float) -> str:
    if not values:
        return f"<= {target:.0f} s: not measured"
    return f"<= {target:g} s: {'met' if summary(values)['median'] <= target else '**missed**'}"


def render(res: dict, args, command: str) -> str:
    m = machine()
    out = ["## Recovery: kill -9, scale-down and scale-up (issue 5)", "",
           f"Command: `{command}`  ",
           f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}, "
           f"{m['os']}; {m['date']}; 1-minute load {m['load_1min']} at the end.", ""]
    if args.quick:
        out += ["**Preliminary** (`--quick`: few kills and cycles; not for conclusions).", ""]
    out += ["The tiny job of the elastic tests (1-layer GPT, gloo, CPU), 200 ms of injected delay "
            "per step, a checkpoint every 2 steps. Times: from the kill (or the new agent's start) "
            "to the first optimizer step completed by the new attempt, from the sample audit. "
            "Median (min-max).", "",
            "### Kill -9 of one worker", "",
            "| job | kills | kill -> next step (s) | steps redone | target |", "|---|---:|---|---|---|"]
    for key, label in (("standalone", "standalone, `--nproc 2 --max-restarts 100` (c10d)"),
                       ("etcd", "2 agents x 1 worker, `--nnodes 1:2 --rdzv-backend etcd`")):
        r = res["kill"][key]
        err = f" ({r['error']})" if r.get("error") else ""
        out.append(f"| {label} | {len(r['recovery'])}{err} | {fmt(summary(r['recovery']), digits=2)} | "
                   f"{fmt(summary(r['redone']), digits=0)} | "
                   f"{verdict(r['recovery'], TARGETS['kill']) if key == 'standalone' else '-'} |")
    out += ["", "### Scale-down and scale-up (`--nnodes 1:2`, 1 worker per agent)", "",
            "| backend | launcher | cycles | scale-down (s) | scale-up (s) | targets |",
            "|---|---|---:|---|---|---|"]
    for (backend, flavor), r in res["scale"].items():
        launcher = "`disttrain run` defaults" if flavor == "disttrain" else "plain torchrun defaults"
        err = r.get("error")
        other = f" ({err})" if err and not err.startswith(("scale-down", "scale-up")) else ""
        targets = (f"down {verdict(r['down'], TARGETS['down'])}; up {verdict(r['up'], TARGETS['up'])}"
                   if flavor == "disttrain" else "the baseline")
        out.append(f"| {backend} | {launcher} | {len(r['down'])}{other} | {_cell(r['down'], err, 'scale-down')} | "
                   f"{_cell(r['up'], err, 'scale-up')} | {targets} |")
    out += ["", "### Split brain", "",
            "| job | cycles | findings |", "|---|---:|---|"]
    for (backend, flavor), r in res["scale"].items():
        if flavor == "disttrain":
            found = "; ".join(r["problems"][:3]) or "none: worlds never overlapped, each sample once per epoch"
            out.append(f"| {backend}, `disttrain run` | {len(r['up'])} | {found} |")
    for key, r in res["kill"].items():
        if r.get("problems"):
            out.append(f"| kill -9, {key} | {len(r['recovery'])} | {'; '.join(r['problems'][:3])} |")
    out += ["", "How the checks work: every attempt writes its own audit file named by its start "
            "time; the poller reads the newest attempt's file first, so a line of an older attempt "
            "seen after a newer attempt's first line was written while both trained (a split brain). "
            "The kept timeline (per step, the newest attempt's records) must have no step gaps and "
            "no sample twice within an epoch; a `StaleWriterError` in any log (the checkpoint "
            "layer's WRITER.json fence refusing a second writer) is reported too.", ""]
    out += notes(res)
    return "\n".join(out) + "\n"


def notes(res: dict) -> list[str]:
    """Plain words on each missed target, from the numbers measured."""
    lines = []
    k = res["kill"]["standalone"]["recovery"]
    if k and summary(k)["median"] > TARGETS["kill"]:
        lines.append(f"- kill -> next step missed {TARGETS['kill']} s: a restart starts fresh Python "
                     "workers (torch import, process group, checkpoint load) before any step; on a "
                     "shared 2-core machine the import alone is most of it.")
    for (backend, flavor), r in res["scale"].items():
        if flavor != "disttrain":
            continue
        for key, what in (("down", "scale-down"), ("up", "scale-up")):
            if r[key] and summary(r[key])["median"] > TARGETS[key]:
                why = ("a dead node is declared after keep_alive_interval x keep_alive_max_attempt "
                       "= 5 s of missed heartbeats, then last_call_timeout = 2 s, then fresh workers "
                       "start; fewer missed beats caused a split brain" if key == "down" else
                       "the new agent imports torch, joins, and every worker restarts")
                lines.append(f"- {backend} {what} missed {TARGETS[key]:g} s: {why}.")
    return (["Where targets are missed, and why:", *lines, ""] if lines else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/recovery_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK") == "1",
                    help="2 kills, 2 cycles, shorter hang timeouts (default from BENCH_QUICK)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))
                    / "recovery.md")
    ap.add_argument("--kills", type=int, help="kills per job in (a) (default 5, quick 2)")
    ap.add_argument("--cycles", type=int, help="scale-down/up cycles, split between c10d and etcd "
                    "(default 20, quick 2)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain torchrun comparison")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    kills = args.kills or (2 if args.quick else 5)
    cycles = args.cycles or (2 if args.quick else 20)
    hang = (60.0, 20.0) if args.quick else (75.0, 45.0)  # plain torchrun: 46.6 s scale-down measured
    shown = [a if not os.path.isabs(a) else "OUT" for a in (sys.argv[1:] if argv is None else argv)]
    command = " ".join(["python bench/recovery_bench.py", *shown]) + (
        "  (BENCH_QUICK=1)" if args.quick and "--quick" not in shown else "")
    rng = random.Random(args.seed)
    res = {"kill": {}, "scale": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for key in ("standalone", "etcd"):
            res["kill"][key] = kill_workers(Path(tmp), key, kills, rng)
            print(f"[recovery] kill {key}: {res['kill'][key]}  ({time.monotonic() - t0:.0f} s)", flush=True)
        for backend, n in (("c10d", (cycles + 1) // 2), ("etcd", cycles // 2)):
            res["scale"][(backend, "disttrain")] = scale_cycles(Path(tmp), backend, n, False, (60.0, 45.0))
            print(f"[recovery] {backend} disttrain: {res['scale'][(backend, 'disttrain')]}  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        for backend in ([] if args.no_plain else ["c10d", "etcd"]):
            res["scale"][(backend, "plain")] = scale_cycles(Path(tmp), backend, 1, True, hang)
            print(f"[recovery] {backend} plain: {res['scale'][(backend, 'plain')]}  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(res, args, command))
    print(f"[recovery] wrote {args.out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
