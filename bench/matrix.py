"""The job matrix: every (workload, world size) that the timing sections need, run
interleaved so that the variants compared in one table share the machine's state.

Each repeat runs every job once, in an order rotated by one place per repeat, so a
slow minute on a shared machine lands on a different variant each time. A section
computes its ratios per repeat (job A and job B of the same repeat) and reports
the median, min and max of those paired ratios.

A job whose framework is not installed, or whose disttrain strategy is not in this
checkout, is skipped with a reason; a job that fails once is not retried and
carries its error into the report.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field

from bench.common import JobError, Options, disttrain_strategies, launch, summary

# name -> (script in bench/workloads, what it needs, label in tables[, environment])
Workload = tuple[str, str | None, str] | tuple[str, str | None, str, dict[str, str]]
WORKLOADS: dict[str, Workload] = {
    "plain": ("plain.py", None, "single device (the starting script)"),
    "torch_ddp": ("torch_ddp.py", None, "hand-written torch DDP"),
    "disttrain_ddp": ("disttrain_ddp.py", "ddp", "disttrain ddp"),
    "torch_fsdp": ("torch_fsdp.py", None, "hand-written torch FSDP2"),
    "disttrain_fsdp": ("disttrain_fsdp.py", "fsdp", "disttrain fsdp"),
    "disttrain_job": ("disttrain_job.py", "ddp", "disttrain Job (resumable)"),
    "accelerate": ("accelerate_run.py", "accelerate", "HF Accelerate"),
    "fabric": ("fabric_run.py", "lightning", "Lightning Fabric"),
    # The product A/B (bench/guard_overhead.py): `disttrain train` with one feature off at a
    # time through its config keys, against the same work written by hand.
    "hand_train": ("hand_train.py", None, "hand-written loop, same work"),
    "hand_train_vote": ("hand_train.py", None, "hand-written + 1 all-reduce / step", {"BENCH_VOTE": "1"}),
    "dt_train": ("trainer_run.py", "ddp", "disttrain train, everything on"),
    "dt_train_no_guard": (
        "trainer_run.py",
        "ddp",
        "disttrain train, guard.enabled=false",
        {"BENCH_TRAIN_ARGS": "--guard.enabled=false"},
    ),
    "dt_train_no_audit": (
        "trainer_run.py",
        "ddp",
        "disttrain train, elastic.record_samples=false",
        {"BENCH_TRAIN_ARGS": "--elastic.record_samples=false"},
    ),
    "dt_train_no_ckpt": (
        "trainer_run.py",
        "ddp",
        "disttrain train, checkpoint.enabled=false",
        {"BENCH_TRAIN_ARGS": "--checkpoint.enabled=false"},
    ),
}

EXTRA_HINT = "pip install -e '.[bench]' (accelerate, lightning)"


def label(name: str) -> str:
    return WORKLOADS[name][2]


def script(name: str) -> str:
    return WORKLOADS[name][0]


def workload_env(name: str) -> dict[str, str]:
    """The environment a job adds to its launch (the A/B switches)."""
    spec = WORKLOADS[name]
    return dict(spec[3]) if len(spec) > 3 else {}


@dataclass
class JobResult:
    name: str
    world: int
    runs: list[dict] = field(default_factory=list)
    """One dict per repeat: repeat, step_s, first_step_s, rss_mb, tokens_per_s."""
    skipped: str = ""
    error: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}@{self.world}"

    @property
    def ok(self) -> bool:
        return bool(self.runs) and not self.error and not self.skipped

    def stat(self, metric: str) -> dict:
        return summary([r[metric] for r in self.runs])

    def note(self) -> str:
        """Why this job has no numbers ('' when it has them)."""
        if self.skipped:
            return f"pending: {self.skipped}"
        if self.error:
            return "failed: " + self.error.strip().splitlines()[-1][:160]
        return "" if self.runs else "not run"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "world": self.world,
            "runs": self.runs,
            "skipped": self.skipped,
            "error": self.error[-3000:],
        }

    @classmethod
    def from_json(cls, d: dict) -> JobResult:
        return cls(d["name"], d["world"], d["runs"], d.get("skipped", ""), d.get("error", ""))


def paired(a: JobResult, b: JobResult, metric: str, *, invert: bool = False) -> dict:
    """Summary of a[metric] / b[metric] over the repeats both have (b / a if `invert`)."""
    bmap = {r["repeat"]: r[metric] for r in b.runs}
    ratios = []
    for r in a.runs:
        if r["repeat"] in bmap and bmap[r["repeat"]] and r[metric]:
            ratios.append(bmap[r["repeat"]] / r[metric] if invert else r[metric] / bmap[r["repeat"]])
    return summary(ratios)


def skip_reason(need: str | None, strategies: set[str], fsdp_note: str) -> str:
    if need is None:
        return ""
    if need in ("accelerate", "lightning"):
        return "" if importlib.util.find_spec(need) else f"{need} is not installed: {EXTRA_HINT}"
    if need not in strategies:
        return fsdp_note or f"dt.wrap(strategy={need!r}) is not available in this checkout"
    return ""


class Matrix:
    """Runs the requested jobs and keeps their results (and profiles) by key."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.jobs: dict[str, JobResult] = {}
        self.profiles: dict[str, dict] = {}
        self.extra: dict[str, object] = {}
        """Measurements shared by sections (the import times)."""
        self.strategies, self.fsdp_note = disttrain_strategies()

    def get(self, name: str, world: int) -> JobResult:
        return self.jobs.get(f"{name}@{world}") or JobResult(name, world, skipped="not run")

    def run(self, wanted: list[tuple[str, int]], log=print) -> None:
        todo: list[JobResult] = []
        for name, world in dict.fromkeys(wanted):
            job = JobResult(name, world)
            job.skipped = skip_reason(WORKLOADS[name][1], self.strategies, self.fsdp_note)
            self.jobs[job.key] = job
            if not job.skipped:
                todo.append(job)
        for repeat in range(self.opts.repeats):
            shift = repeat % max(1, len(todo))
            for job in todo[shift:] + todo[:shift]:
                if job.error:
                    continue
                log(f"  repeat {repeat + 1}/{self.opts.repeats}: {job.key}")
                try:
                    res = self._launch(job)
                except JobError as e:
                    job.error = str(e)
                    log(f"    failed: {str(e).splitlines()[0]}")
                    continue
                job.runs.append(
                    {
                        "repeat": repeat,
                        "step_s": res.step_s,
                        "first_step_s": res.first_step_s,
                        "rss_mb": res.rss_mb,
                        "tokens_per_s": res.tokens_per_s,
                        "cpu_s": res.cpu_s,
                    }
                )
            sys.stdout.flush()

    def _launch(self, job: JobResult):
        """One launch; a failure is tried once more (a port taken between `free_port` and
        the rendezvous, on a shared machine, is not the workload's fault)."""
        try:
            return launch(script(job.name), job.world, self.opts, env=workload_env(job.name))
        except JobError as e:
            print(f"    retrying once: {str(e).splitlines()[0]}")
            return launch(script(job.name), job.world, self.opts, env=workload_env(job.name))

    def profile(self, name: str, world: int, kind: str = "steps") -> dict | None:
        """A cProfile of one launch of the job (cached): 'steps' profiles the timed steps,
        'startup' the whole process. None when the job has no successful run."""
        from bench.profiles import profile_job

        key = f"{name}@{world}:{kind}"
        if key not in self.profiles:
            job = self.jobs.get(f"{name}@{world}")
            if job is None or not job.ok:
                return None
            self.profiles[key] = profile_job(script(name), world, self.opts, kind)
        return self.profiles[key]
