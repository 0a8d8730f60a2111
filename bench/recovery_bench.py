"""Recovery benchmark (issue 5): how fast an elastic job gets back to training.

    python bench/recovery_bench.py [--quick] [--out FILE] [--kills 5] [--cycles 20] [--no-plain]

Runs the real trainer (the elastic tests' tiny job of examples/tiny_gpt.toml, 200 ms
of delay per step, a checkpoint every 2 steps) and writes a markdown section to
--out (default bench/results/recovery.md, or $BENCH_RESULTS/recovery.md from
`python -m bench --others`, which also sets --quick through BENCH_QUICK=1):
(a) kill -9 of one worker -> first step of the resumed attempt, and steps redone,
    for a standalone job (`--max-restarts`) and two agents on etcd (`--nnodes 1:2`);
(b) scale-down (one agent's whole process tree killed -> first step at world 1) and
    scale-up (a new agent -> first step at world 2), c10d and etcd, `disttrain run`
    defaults vs plain torchrun's (no rdzv-conf, shared TCP store on); a wait past its
    timeout shows as "hung (> N s)";
(c) split brain over `--cycles` of (b) (half c10d, half etcd): no two worlds at once.
Times come from the sample audit: each attempt writes samples/gen{G}-rank{r}.jsonl, G
being rank 0's clock (ns) once its ranks are up; a step's time is its file's mtime.
Targets are reported, not asserted; the exit status is 0.
"""

from __future__ import annotations

import argparse
import datetime
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


def phases(t0: int, job: "Job", first: dict, failure: bool) -> dict:
    """Seconds from `t0` (ns) to: the agent logging the failed worker ("detect"), the new
    attempt's ranks up with the checkpoint loaded (its generation stamp), `first` step."""
    out = {"total": (first["t"] - t0) / 1e9, "ready": (first["generation"] - t0) / 1e9,
           "step": (first["t"] - first["generation"]) / 1e9}
    if failure:
        seen = [t for t in job.log_times("failed (exitcode") if t > t0]
        out["detect"] = (min(seen) - t0) / 1e9 if seen else None
    return out


class Job:
    """Agents of one run sharing an output folder, and a poller of its sample audit."""

    def __init__(self, tmp: Path, name: str, plain: bool = False):
        self.out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
        self.plain, self.agents, self.logs, self.violations, self.polls = plain, [], [], [], 0
        self.lines: dict[int, list[dict]] = {}  # generation -> its records
        self.first_poll: dict[int, int] = {}  # generation -> the poll that first saw it
        self._offsets: dict[Path, int] = {}

    def start_agent(self, flags: list[str]) -> subprocess.Popen:
        env = {**base_env(threads=1), "DISTTRAIN_FAULT": SLOW}
        if self.plain:  # plain torchrun: its own defaults, shared TCP store included
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
            launcher = [sys.executable, "-m", "torch.distributed.run"]
        else:
            launcher = [sys.executable, "-m", "disttrain.cli", "run"]
        log = self.out / f"agent{len(self.agents)}.txt"
        cmd = [*launcher, *flags, "-m", "disttrain.trainer", "examples/tiny_gpt.toml", *TINY,
               f"--train.out_dir={self.out}"]
        # Own session: the agent and its workers can be killed as one node.
        self.agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"),
                                            stderr=subprocess.STDOUT, start_new_session=True))
        self.logs.append(log)
        return self.agents[-1]

    def poll(self) -> None:
        """Read new complete audit lines, newest generation first: an older generation's
        line first seen after a newer one started was written while the newer trained."""
        self.polls += 1
        files = sorted((self.out / "samples").glob("gen*-rank*.jsonl"),
                       key=lambda p: -int(p.name[3:].split("-")[0]))
        for f in files:
            try:  # stat after the read: mtime is then at or after every line read
                with f.open("rb") as fh:
                    fh.seek(self._offsets.get(f, 0))
                    data = fh.read()
                mtime = f.stat().st_mtime_ns
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # complete lines only
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

    def log_times(self, needle: str) -> list[int]:
        """Times (ns) of the agents' torch log lines that contain `needle`."""
        year = datetime.date.today().year  # torch's glog prefix: "E1130 10:10:22.275000 PID ..."
        return [int(datetime.datetime.strptime(f"{year}{line[1:21]}", "%Y%m%d %H:%M:%S.%f").timestamp() * 1e9)
                for log in self.logs for line in log.read_text(errors="replace").splitlines()
                if needle in line and line[:1] in "IWEF" and line[1:5].isdigit()]

    def records(self) -> list[dict]:
        return [r for lines in self.lines.values() for r in lines]

    def wait_first(self, after_ns: int, world: int | None, timeout: float, what: str) -> dict:
        """The first record of an attempt started after `after_ns` (at `world`, if given).
        Raises `Hung` after `timeout` s, or at once when every agent has exited."""
        def found():
            rs = [r for r in self.records() if r["generation"] > after_ns and world in (None, r["world"])]
            return min(rs, key=lambda r: r["t"]) if rs else None
        return self._until(found, timeout, what)

    def wait_steps(self, after_ns: int, n: int, timeout: float = 60) -> None:
        """Wait until attempts started after `after_ns` have committed `n` steps."""
        self._until(lambda: len({r["step"] for r in self.records() if r["generation"] > after_ns}) >= n,
                    timeout, f"{n} steps")

    def _until(self, found, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            value = found()
            if value:
                return value
            if self.agents and all(a.poll() is not None for a in self.agents):
                raise Hung(f"every agent exited before {what}")
            time.sleep(0.05)
        raise Hung(f"hung (> {timeout:.0f} s)")

    def audit(self) -> list[str]:
        """Split-brain and exactly-once findings over everything recorded (empty: clean)."""
        problems = list(dict.fromkeys(self.violations))
        for gen, lines in self.lines.items():
            worlds, ranks = {r["world"] for r in lines}, {r["rank"] for r in lines}
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
            a.wait()  # SIGKILL: no wait beyond the kernel's


def children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                           text=True).stdout.split()]


def kill_tree(pid: int) -> None:
    """A node failure: the agent and every process under it (workers run in sessions of
    their own, so the agent's process group alone would leave them running)."""
    kids = children(pid)  # before the kill: orphans are re-parented and lost to pgrep -P
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for kid in kids:
        kill_tree(kid)


def elastic_flags(backend: str, endpoint: str, plain: bool) -> list[str]:
    rdzv = "etcd-v2" if plain and backend == "etcd" else backend  # disttrain maps etcd -> etcd-v2
    return ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", rdzv, "--rdzv-endpoint",
            endpoint, "--rdzv-id", f"bench-{backend}", "--max-restarts", "100"]


def kill_workers(tmp: Path, backend: str, kills: int, rng: random.Random) -> dict:
    """(a): kill -9 one worker `kills` times; recovery seconds and steps redone."""
    job, server = Job(tmp, f"kill-{backend}"), None
    out = {"recovery": [], "redone": []}
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
            out["recovery"].append(phases(t_kill, job, first, failure=True))
            out["redone"].append(max(done, before) - (first["step"] - 1))
            job.wait_steps(t_kill, 3)
    except Hung as e:
        out["error"] = str(e)
    finally:
        job.stop()
        if server:
            server.stop()
    return {**out, "problems": job.audit()}


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
            down.append(phases(t_kill, job, first, failure=True))
            t_start, phase = time.time_ns(), "scale-up"
            job.start_agent(elastic_flags(backend, endpoint, plain))
            first = job.wait_first(t_start, 2, timeouts[1], "world 2")
            up.append(phases(t_start, job, first, failure=False))
            phase = "training at world 2"
            job.wait_steps(t_start, 2)
    except Hung as e:
        result["error"] = f"{phase}: {e}"
    finally:
        job.stop()
        if server:
            server.stop()
    return {**result, "down": down, "up": up, "problems": job.audit()}


def totals(events: list[dict]) -> list[float]:
    return [e["total"] for e in events]


def _cell(events: list[dict], error: str | None, which: str) -> str:
    """'median (min-max)' of the events' totals, and the hang that ended the run, if any."""
    hang = error.split(": ", 1)[1] if error and error.startswith(which) else ""
    if not events:
        return hang or "n/a"
    return fmt(summary(totals(events)), digits=2) + (f"; then {hang}" if hang else "")


def verdict(events: list[dict], target: float) -> str:
    if not events:
        return f"<= {target:g} s: not measured"
    return f"<= {target:g} s: {'met' if summary(totals(events))['median'] <= target else '**missed**'}"


def _median(events: list[dict], key: str) -> str:
    values = [e[key] for e in events if e.get(key) is not None]
    return f"{summary(values)['median']:.2f}" if values else "-"


def import_seconds() -> dict:
    """Wall seconds of `import torch` and of `import disttrain.trainer` in fresh
    interpreters, two at once (a restart starts both workers together), after an untimed
    import that warms the file cache (workers that restart find it warm too)."""
    out = {}
    for name, module in (("warm", "disttrain.trainer"), ("torch", "torch"), ("disttrain", "disttrain.trainer")):
        t0 = time.monotonic()
        for proc in [subprocess.Popen([sys.executable, "-c", f"import {module}"], env=base_env(), cwd=ROOT)
                     for _ in range(2)]:
            proc.wait(timeout=120)
        out[name] = time.monotonic() - t0
    return out


def render(res: dict, args, command: str) -> str:
    """The markdown section: tables (a), (b), the time breakdown, (c), and the misses."""
    m, imports, rows = machine(), res["imports"], []  # rows: (label, events) for the breakdown
    out = ["## Recovery: kill -9, scale-down and scale-up (issue 5)", "", f"Command: `{command}`  ",
           f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}, {m['os']}; "
           f"{m['date']}; 1-minute load {res['load_start']} at the start, {m['load_1min']} at the end.", ""]
    if args.quick:
        out += ["**Preliminary** (`--quick`: few kills and cycles; not for conclusions).", ""]
    out += ["The tiny job of the elastic tests (1-layer GPT, gloo, CPU), 200 ms of injected delay per "
            "step, a checkpoint every 2 steps. Times run from the kill (or the new agent's start) to the "
            "first optimizer step completed by the new attempt, read from the sample audit. Median (min-max).",
            "", "### Kill -9 of one worker", "",
            "| job | kills | kill -> next step (s) | steps redone | target |", "|---|---:|---|---|---|"]
    for key, label in (("standalone", "standalone, `--nproc 2 --max-restarts` (c10d)"),
                       ("etcd", "2 agents x 1 worker, `--nnodes 1:2 --rdzv-backend etcd`")):
        r = res["kill"][key]
        err = f" ({r['error']})" if r.get("error") else ""
        target = verdict(r["recovery"], TARGETS["kill"]) if key == "standalone" else "-"
        out.append(f"| {label} | {len(r['recovery'])}{err} | {_cell(r['recovery'], None, '')} | "
                   f"{fmt(summary(r['redone']), digits=0)} | {target} |")
        rows.append((f"kill -9, {key}", r["recovery"]))
    out += ["", "### Scale-down and scale-up (`--nnodes 1:2`, 1 worker per agent)", "",
            "| backend | launcher | cycles | scale-down (s) | scale-up (s) | targets |", "|---|---|---:|---|---|---|"]
    for (backend, flavor), r in res["scale"].items():
        err = r.get("error")
        other = f" ({err})" if err and not err.startswith(("scale-down", "scale-up")) else ""
        targets = (f"down {verdict(r['down'], TARGETS['down'])}; up {verdict(r['up'], TARGETS['up'])}"
                   if flavor == "disttrain" else "the baseline")
        out.append(f"| {backend} | {'`disttrain run`' if flavor == 'disttrain' else 'plain torchrun'} defaults "
                   f"| {len(r['down'])}{other} | {_cell(r['down'], err, 'scale-down')} | "
                   f"{_cell(r['up'], err, 'scale-up')} | {targets} |")
        rows += [(f"{backend} scale-down, {flavor}", r["down"]), (f"{backend} scale-up, {flavor}", r["up"])]
    out += ["", "Where the time goes (medians, s): *agent notices* = torchrun logs the failed worker; "
            "*workers ready* = the new attempt's ranks have started, imported, joined the process group "
            "and loaded the checkpoint; *first step* = a held-out eval and one step. Fresh interpreters, "
            f"two at once, on this machine: `import torch` {imports['torch']:.2f} s, "
            f"`import disttrain.trainer` {imports['disttrain']:.2f} s.", "",
            "| event | agent notices | workers ready | then first step | total |", "|---|---:|---:|---:|---:|"]
    out += [f"| {label} | {_median(ev, 'detect')} | {_median(ev, 'ready')} | {_median(ev, 'step')} | "
            f"{_median(ev, 'total')} |" for label, ev in rows if ev]
    out += ["", "### Split brain", "", "| job | cycles | findings |", "|---|---:|---|"]
    out += [f"| {b}, {f} | {len(r['down'])} | "
            f"{'; '.join(r['problems'][:3]) or 'none: no two worlds overlapped; each sample once per epoch'} |"
            for (b, f), r in res["scale"].items()]
    out += [f"| kill -9, {k} | {len(r['recovery'])} | {'; '.join(r['problems'][:3]) or 'none'} |"
            for k, r in res["kill"].items()]
    out += ["", "Checks: a line of an older attempt's audit first seen after a newer attempt's first "
            "line (the newest file is read first) means two worlds trained at once; the kept timeline "
            "(per step, the newest attempt) must have no step gaps and no sample twice in an epoch; a "
            "`StaleWriterError` in a log (the WRITER.json fence refusing a writer) is reported.", ""]
    return "\n".join(out + notes(res)) + "\n"


def notes(res: dict) -> list[str]:
    """Plain words on each missed target, from the phases measured."""
    checks = [("kill -> next step", res["kill"]["standalone"]["recovery"], TARGETS["kill"])]
    checks += [(f"{b} scale-{k}", r[k], TARGETS[k]) for (b, f), r in res["scale"].items()
               if f == "disttrain" for k in ("down", "up")]
    lines = []
    for what, events, target in checks:
        if events and summary(totals(events))["median"] > target:
            noticed = f" (the agent notices in {_median(events, 'detect')} s)" if "up" not in what else ""
            why = (f"the new attempt's workers are ready {_median(events, 'ready')} s after the "
                   f"{'new agent starts' if 'up' in what else 'kill'}{noticed}; that includes fresh "
                   f"interpreters importing disttrain and torch (two at once: "
                   f"{res['imports']['disttrain']:.2f} s here, torch alone {res['imports']['torch']:.2f} s)")
            if "down" in what:
                why += ("; scale-down also waits out the dead node's heartbeats (5 x 1 s: fewer "
                        "missed beats caused a split brain) and the 2 s last call")
            lines.append(f"- {what} missed {target:g} s: {why}.")
    return ["Where targets are missed, and why:", *lines, ""] if lines else []


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
    hang = (60.0, 20.0) if args.quick else (70.0, 30.0)  # plain torchrun: 46.6 s scale-down measured
    shown = [a if not os.path.isabs(a) else "OUT" for a in (sys.argv[1:] if argv is None else argv)]
    command = " ".join(["python bench/recovery_bench.py", *shown]) + (
        "  (BENCH_QUICK=1)" if args.quick and "--quick" not in shown else "")
    rng, t0 = random.Random(args.seed), time.monotonic()

    def done(what: str, r: dict) -> None:
        print(f"[recovery] {what}: {r}  ({time.monotonic() - t0:.0f} s)", flush=True)

    res = {"kill": {}, "scale": {}, "load_start": round(os.getloadavg()[0], 2), "imports": import_seconds()}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        for key in ("standalone", "etcd"):
            done(f"kill {key}", res["kill"].setdefault(key, kill_workers(Path(tmp), key, kills, rng)))
        for backend, n in (("c10d", (cycles + 1) // 2), ("etcd", cycles // 2)):
            r = res["scale"][(backend, "disttrain")] = scale_cycles(Path(tmp), backend, n, False, (60.0, 45.0))
            done(f"{backend} disttrain", r)
        for backend in ([] if args.no_plain else ["c10d", "etcd"]):
            done(f"{backend} plain", res["scale"].setdefault((backend, "plain"),
                                                            scale_cycles(Path(tmp), backend, 1, True, hang)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(res, args, command))
    print(f"[recovery] wrote {args.out} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
