"""What every benchmark section shares: the options, the machine description, the
statistics, and the launcher that runs a workload script on N local ranks.

The launcher starts each rank as a plain Python process with the environment that
torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT), without torchrun's elastic agent. Every
framework under test reads that environment, and leaving the agent out keeps its
start-up time (the same for all) out of "time to first step", which is measured
from the moment the launcher starts the rank's process (BENCH_T0).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
WORKLOADS = BENCH / "workloads"


@dataclass
class Options:
    """How much to measure. `quick` is a smoke run: few steps and repeats."""

    quick: bool = False
    repeats: int = 5
    steps: int = 20
    warmup: int = 3
    profile: bool = True
    """Profile the variant behind a missed target and put the top functions in the report."""
    out_dir: Path = ROOT
    """Where BENCHMARKS.md goes; results (JSON, PNG, markdown) go to out_dir/bench/results."""
    command: str = "python -m bench"
    timeout_s: float = 240.0

    @property
    def results(self) -> Path:
        return self.out_dir / "bench" / "results"


def machine() -> dict:
    """Cores, CPU model, torch and Python versions, date, and the load at this moment."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def summary(values: list[float]) -> dict:
    """Median, min, max and count of `values` (nan-free); an empty dict for no values."""
    values = [v for v in values if v is not None and v == v]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(s: dict, scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """'median (min-max)' of a `summary`, or 'n/a'."""
    if not s:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'] * scale)}{unit} ({f.format(s['min'] * scale)}-{f.format(s['max'] * scale)})"


def variant_table(first: str, columns: list[tuple[str, str, int]], rows: list[dict]) -> list[str]:
    """The markdown lines of a table of variants: a header of `first`, each column's
    heading and "runs", then one line per row of `analyse` ({"label", "note", "runs",
    KEY: summary}). `columns` are (heading, KEY, digits): each cell is `fmt` of
    row[KEY] ("n/a" when the row lacks it). A row with a note (a failed or pending
    job) shows the note in place of its figures and 0 runs."""
    out = ["| " + " | ".join([first, *(c[0] for c in columns), "runs"]) + " |", "|" + "---|" * (len(columns) + 2)]
    for row in rows:
        cells = (
            [row["note"], *[""] * (len(columns) - 1), "0"]
            if row["note"]
            else [*(fmt(row.get(key, {}), digits=d) for _, key, d in columns), str(row["runs"])]
        )
        out.append(" ".join(["|", row["label"], "|", *(f"{c} |" if c else "|" for c in cells)]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(threads: int = 1) -> dict[str, str]:
    """The parent environment with one compute thread per rank and src/ importable."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
        }
    )
    paths = [str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class JobError(RuntimeError):
    """A benchmark job failed; the message ends with the tail of its output."""


@dataclass
class Job:
    """One launch of a workload on `world` ranks, summarised over its ranks."""

    script: str
    world: int
    ranks: list[dict] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        """Median seconds per optimizer step on the slowest rank."""
        return max(statistics.median(r["step_s"]) for r in self.ranks)

    @property
    def first_step_s(self) -> float:
        """Seconds from process start to the end of the first optimizer step, slowest rank."""
        return max(r["first_step_s"] for r in self.ranks)

    @property
    def cpu_s(self) -> float | None:
        """CPU seconds per step of the busiest rank, for workloads that report it."""
        values = [r["cpu_s"] for r in self.ranks if "cpu_s" in r]
        return max(values) if values else None

    @property
    def rss_mb(self) -> float:
        """Peak resident memory of the largest rank, MiB."""
        return max(r["peak_rss_mb"] for r in self.ranks)

    @property
    def tokens_per_s(self) -> float:
        return self.world * self.ranks[0]["tokens_per_step"] / self.step_s


def launch(
    script: str,
    world: int,
    opts: Options,
    *,
    env: dict | None = None,
    prefix: list[str] | None = None,
    steps: int | None = None,
) -> Job:
    """Run bench/workloads/SCRIPT on `world` local ranks and collect every rank's JSON.

    `prefix` goes between the interpreter and the script (for example
    `-m cProfile -o FILE`; '{rank}' in it is replaced). Raises `JobError` naming the
    script, the world size and the output tail when a rank fails or the job
    exceeds `opts.timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        port = free_port()
        procs = []
        for rank in range(world):
            e = base_env()
            e.update(env or {})
            e.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world),
                    "GROUP_RANK": "0",
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "BENCH_OUT": tmp,
                    "BENCH_STEPS": str(steps or opts.steps),
                    "BENCH_WARMUP": str(opts.warmup),
                }
            )
            pre = [p.replace("{rank}", str(rank)) for p in (prefix or [])]
            cmd = [sys.executable, *pre, str(WORKLOADS / script)]
            log = open(Path(tmp, f"log{rank}.txt"), "w")
            e["BENCH_T0"] = repr(time.time())
            procs.append((subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT, cwd=tmp), log))
        deadline = time.monotonic() + opts.timeout_s
        failed = None
        for rank, (p, log) in enumerate(procs):
            code: int | str
            try:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0 and failed is None:
                failed = (rank, code)
                for q, _ in procs:  # one rank failed: the others would wait on it forever
                    if q.poll() is None:
                        q.kill()
            log.close()
        if failed:
            rank, code = failed
            tail = Path(tmp, f"log{rank}.txt").read_text()[-2500:]
            raise JobError(f"{script} at world {world}: rank {rank} exited {code}\n{tail}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return Job(script, world, ranks)


def run_python(
    code: str, *, env: dict | None = None, args: list[str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python [args] -c CODE` in a fresh process with the bench environment."""
    e = base_env()
    e.update(env or {})
    return subprocess.run(
        [sys.executable, *(args or []), "-c", code], env=e, text=True, capture_output=True, timeout=timeout, cwd=ROOT
    )


def save(opts: Options, name: str, data: dict) -> Path:
    """Write a section's results to results/NAME.json with its command and machine."""
    opts.results.mkdir(parents=True, exist_ok=True)
    data = {"section": name, "command": opts.command, "quick": opts.quick, "machine": machine(), **data}
    path = opts.results / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def command_line(argv: list[str]) -> str:
    """The command as run, with an absolute --output folder shown as OUTDIR (no machine paths)."""
    shown = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev == "--output" and os.path.isabs(a):
            a = "OUTDIR"
        elif a.startswith("--output=") and os.path.isabs(a.split("=", 1)[1]):
            a = "--output=OUTDIR"
        shown.append(shlex.quote(a))
    return " ".join(["python -m bench", *shown])


def disttrain_strategies() -> tuple[set[str], str]:
    """Strategies that `dt.wrap` accepts here, and a note for those it does not (yet)."""
    r = run_python(
        "import json, importlib.util as u, disttrain.config as c;"
        "print(json.dumps([s for s in c.STRATEGIES if s != 'fsdp' "
        "or u.find_spec('disttrain.parallel.fsdp')]))"
    )
    if r.returncode != 0:
        return {"ddp"}, "disttrain's strategy list could not be read: " + r.stderr[-300:]
    found = set(json.loads(r.stdout))
    note = (
        ""
        if "fsdp" in found
        else ("dt.wrap(strategy='fsdp') is not in this checkout yet; fsdp rows are pending until it lands.")
    )
    return found, note
