"""Kill a whole node -> next committed step, when fast recovery shrinks the job in memory.

    python bench/node_loss_bench.py            # 3 kills per strategy; bench/results/recovery_node.md
    python bench/node_loss_bench.py --kills 1 --strategies fsdp

Each kill is a job of its own: 2 agents x NPROC workers (two "nodes" on loopback, NPROC
2 by default) under `disttrain run --rdzv-backend etcd`, `[elastic] fast_recovery = true`,
`node_lease_s = 0.5`, 150 ms injected per step, no spare node. Once step 6 is committed,
kill -9 takes the whole process tree of the node that holds rank 0 (agent, slot
supervisors, training processes, spares). Timed: the kill to the first step the
survivors commit at world NPROC (the sample audit's `time_ns`); then the job must end by
itself (exit 0) with the launcher's line that it finished at world NPROC. Compared with
the torchrun restart path's scale-down and scale-up on this machine
(bench/results/recovery_scale.md: 6.9 s and 4.3 s before fast recovery covered a node).
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

if __package__ in (None, ""):  # `python bench/node_loss_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import base_env, machine
from bench.recovery_job import ROOT, TINY, kill_tree

STEPS = 20
KILL_AFTER = 6
GOAL_S = 1.5
RESTART_PATH = {"scale-down": 6.9, "scale-up": 4.3}
"""The torchrun restart path on this machine before fast recovery covered a node (recovery_scale)."""
LEASE_S = 0.5


def audit(out: Path) -> list[dict]:
    records = []
    for f in (out / "samples").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def wait(predicate, timeout: float, what: str, agents: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if all(a.poll() is not None for a in agents):
            raise RuntimeError(f"every agent exited before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {timeout:.0f} s")


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """An agent in a session of its own, so that its whole tree can be killed as one node."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
    )


def one_kill(tmp: Path, strategy: str, endpoint: str, run_id: str, nproc: int) -> dict:
    """One job, one node killed: seconds to the next step, and how the job ended."""
    out = Path(tempfile.mkdtemp(prefix=f"node-{strategy}-", dir=tmp))
    env = {**base_env(threads=1), "DISTTRAIN_FAULT": "delay@step:ms=150", "DISTTRAIN_JOB_SECRET": "cd" * 32}
    flags = ["--nnodes", "2", "--nproc", str(nproc), "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint]
    cmd = [sys.executable, "-m", "disttrain.cli", "run", *flags, "--rdzv-id", run_id, "-m", "disttrain.train"]
    cmd += ["examples/tiny_gpt.toml", *TINY, f"--train.steps={STEPS}", "--elastic.fast_recovery=true"]
    cmd += [f"--elastic.node_lease_s={LEASE_S}"]
    cmd += [f"--parallel.strategy={strategy}", f"--train.out_dir={out}"]
    logs = [out / f"node{i}.txt" for i in range(2)]
    agents = [start(cmd, log, env) for log in logs]
    try:
        wait(lambda: any(r["step"] >= KILL_AFTER for r in audit(out)), 180, f"step {KILL_AFTER}", agents)
        node0 = next(i for i, log in enumerate(logs) if "rank 0 (local rank 0) is pid" in log.read_text())
        t_kill = time.time_ns()
        kill_tree(agents[node0].pid)
        first = wait(
            lambda: min((r["time_ns"] for r in audit(out) if r["world"] == nproc and r["time_ns"] > t_kill), default=0),
            120,
            f"step at world {nproc}",
            agents[1 - node0 : 2 - node0],
        )
        survivor = agents[1 - node0]
        rc = survivor.wait(timeout=120)
        ended = (time.time_ns() - t_kill) / 1e9
        text = logs[1 - node0].read_text()
        last = text.rstrip().splitlines()[-1] if text.strip() else ""
        if rc != 0:  # the survivor's own words, for whoever reads the bench's output
            print(text[-3000:], flush=True)
        return {
            "seconds": (first - t_kill) / 1e9,
            "rc": rc,
            "ended_s": ended,
            "last_line": last.startswith(f"disttrain run: finished at world {nproc}:"),
            "resharded": f"the world changed ({2 * nproc} -> {nproc} ranks), so the shards are resharded" in text,
            "from_buddies": "resharded from the buddy copies in memory" in text,
            "probe": "their node refused a connection to them" in text,  # not the lease (elastic/liveness.py)
        }
    finally:
        for a in agents:
            kill_tree(a.pid)
            a.wait()


def cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def failed_run(e: Exception) -> dict:
    """A run that did not finish, as the results table says it: what went wrong, never a
    command line (a timeout's names this machine's paths)."""
    if isinstance(e, subprocess.TimeoutExpired):
        return {"error": f"a process did not end within {e.timeout:.0f} s"}
    return {"error": str(e).splitlines()[0][:120]}


def render(res: dict, argv: list[str], took: float, load_end: float, nproc: int) -> str:
    m = res["machine"]
    lines = [
        "## Fast recovery: a lost node with no spare -> the survivors shrink in memory",
        "",
        f"Command: `{shlex.join(['python', 'bench/node_loss_bench.py', *argv])}`  ",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}; {m['date']}; "
        f"1-minute load {m['load_1min']} at the start, {load_end:.2f} at the end (a shared machine). "
        f"The run took {took:.0f} s.",
        "",
        "| strategy | kills | kill -> next committed step (s) | goal | restart path (torchrun) today | job's end |",
        "|---|---:|---|---|---|---|",
    ]
    for strategy, runs in res["runs"].items():
        secs = [r["seconds"] for r in runs if "seconds" in r]
        ok = [r for r in runs if r.get("rc") == 0 and r.get("last_line")]
        met = secs and statistics.median(secs) <= GOAL_S
        restart = f"scale-down {RESTART_PATH['scale-down']} s, scale-up {RESTART_PATH['scale-up']} s"
        ends = f"exit 0 with the launcher's line, by itself: {len(ok)} of {len(runs)}"
        lines.append(
            f"| {strategy}, 2 nodes x {nproc} -> 1 x {nproc} | {len(secs)} | {cell(secs)} | "
            f"<= {GOAL_S} s: {'met' if met else '**missed**'} | {restart} | {ends} |"
        )
    lines += ["", "Per kill:", "", "| strategy | kill -> next step (s) | kill -> survivor's exit (s) | exit | notes |"]
    lines.append("|---|---|---|---|---|")
    for strategy, runs in res["runs"].items():
        for r in runs:
            if "error" in r:
                lines.append(f"| {strategy} | n/a | n/a | n/a | {r['error']} |")
                continue
            note = "the disk checkpoint, resharded (the world changed)" if r["resharded"] else "state from memory"
            note += "; the shards rebuilt from the buddy copies" if r.get("from_buddies") else ""
            note += "; the lost node found by the probes" if r.get("probe") else "; the lost node found by the lease"
            lines.append(f"| {strategy} | {r['seconds']:.2f} | {r['ended_s']:.1f} | {r['rc']} | {note} |")
    lines += [
        "",
        "A node whose process tree is killed on a host that still runs is found by the supervisors' probes "
        f"(elastic/liveness.py: its host refuses them), with no lease ({LEASE_S} s without a beat) to wait; a "
        "machine that lost power costs the lease. Under FSDP the reshard follows: every old rank's buddy "
        "pack broadcast to the survivors and cut into the smaller world's pieces (the disk checkpoint when "
        "a piece is missing). The survivor's exit includes the rest of the run's steps.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python bench/node_loss_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3, help="kills (jobs) per strategy")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/recovery_node.md")
    a = ap.parse_args(argv)
    from disttrain.launch.etcd_server import EtcdServer

    t0, res = time.monotonic(), {"machine": machine(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp, EtcdServer().start() as server:
        for strategy in a.strategies.split(","):
            runs = res["runs"].setdefault(strategy, [])
            for k in range(a.kills):
                try:
                    runs.append(one_kill(Path(tmp), strategy, server.endpoint, f"node-{strategy}-{k}", a.nproc))
                except (RuntimeError, subprocess.TimeoutExpired, StopIteration) as e:
                    runs.append(failed_run(e))
                print(strategy, runs[-1], flush=True)
    load_end = os.getloadavg()[0]
    a.out.write_text(render(res, argv, time.monotonic() - t0, load_end, a.nproc))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
