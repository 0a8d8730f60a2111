"""The elastic job that bench/recovery_bench.py times: the real trainer on the elastic
tests' tiny config, watched through its sample audit (one file per attempt, a step's
time is its file's mtime), and the process-tree helpers that kill parts of it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import base_env

ROOT = Path(__file__).resolve().parent.parent

# The tiny job of tests/elastic_helpers.py: 768 chunks, 96 steps of 8 samples per epoch.
TINY = [
    "--model.n_layer=1",
    "--model.n_embd=32",
    "--model.n_head=2",
    "--model.block_size=32",
    "--model.dropout=0.1",
    "--data.max_bytes=24577",
    "--data.drop_last=true",
    "--train.batch_size=4",
    "--train.eval_every=0",
    "--train.eval_batches=1",
    "--train.log_every=1",
    "--optim.lr=0.01",
    "--checkpoint.keep_last=2",
    "--elastic.record_samples=true",
    "--train.steps=100000",
    "--checkpoint.every=2",
]
EPOCH_STEPS = 96
SLOW = "delay@step:ms=200"
TARGETS = {"kill": 3.0, "down": 8.0, "up": 6.0}


class Hung(Exception):
    """A wait ran past its timeout (the job hung or died)."""


def phases(t0: int, job: Job, first: dict, failure: bool) -> dict:
    """Seconds from `t0` (ns) to: the agent logging the failed worker ("detect"), the new
    attempt's ranks up with the checkpoint loaded (its generation stamp), `first` step."""
    out = {
        "total": (first["t"] - t0) / 1e9,
        "ready": (first["generation"] - t0) / 1e9,
        "step": (first["t"] - first["generation"]) / 1e9,
    }
    if failure:
        seen = [t for t in job.log_times("failed (exitcode") if t > t0]
        out["detect"] = (min(seen) - t0) / 1e9 if seen else None
    return out


class Job:
    """Agents of one run sharing an output folder, and a poller of its sample audit."""

    def __init__(self, tmp: Path, name: str, plain: bool = False):
        self.out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
        self.plain, self.polls = plain, 0
        self.agents: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.violations: list[str] = []
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
        cmd = [
            *launcher,
            *flags,
            "-m",
            "disttrain.train",
            "examples/tiny_gpt.toml",
            *TINY,
            f"--train.out_dir={self.out}",
        ]
        # Own session: the agent and its workers can be killed as one node.
        self.agents.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        self.logs.append(log)
        return self.agents[-1]

    def poll(self) -> None:
        """Read new complete audit lines, newest generation first: an older generation's
        line first seen after a newer one started was written while the newer trained."""
        self.polls += 1
        files = sorted((self.out / "samples").glob("gen*-rank*.jsonl"), key=lambda p: -int(p.name[3:].split("-")[0]))
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
                    self.violations.append(
                        f"generation {gen} wrote step {r['step']} after generation {max(newer)} had started"
                    )
                self.lines.setdefault(gen, []).append(r)

    def log_times(self, needle: str) -> list[int]:
        """Times (ns) of the agents' torch log lines that contain `needle`."""
        year = datetime.date.today().year  # torch's glog prefix: "E1130 10:10:22.275000 PID ..."
        return [
            int(datetime.datetime.strptime(f"{year}{line[1:21]}", "%Y%m%d %H:%M:%S.%f").timestamp() * 1e9)
            for log in self.logs
            for line in log.read_text(errors="replace").splitlines()
            if needle in line and line[:1] in "IWEF" and line[1:5].isdigit()
        ]

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
        self._until(
            lambda: len({r["step"] for r in self.records() if r["generation"] > after_ns}) >= n, timeout, f"{n} steps"
        )

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
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


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
