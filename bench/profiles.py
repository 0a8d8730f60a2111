"""Profiles that explain a missed target: cProfile of a whole job, and `-X importtime`.

A step-time miss is explained by a profile of the timed steps only (the harness
starts cProfile after the warm-up), a start-up miss by a profile of the whole
process (`python -m cProfile`, imports included): in both, the functions on which
the disttrain job spends more of its own time (tottime) than the hand-written job.
A scaling miss is explained by where the 2-rank job's steps spend their time; an import miss by the modules that
`import disttrain` loads after torch, by cumulative import time. The profiles run
with fewer steps than the timed jobs and cProfile slows Python code down, so their
seconds explain, they do not measure.
"""

from __future__ import annotations

import pstats
import re
import tempfile
from pathlib import Path

from bench.common import JobError, Options, launch, run_python

PROFILE_STEPS = 8


def _where(filename: str) -> str:
    """A short, machine-independent name for a profiled file."""
    for marker in ("site-packages/", "/src/", "/bench/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    if filename.startswith("<") or filename == "~":
        return "builtin"
    return Path(filename).name


def profile_job(script: str, world: int, opts: Options, kind: str = "steps") -> dict:
    """cProfile rank 0 of one launch: {'funcs': {func: (tottime, cumtime)}, 'total_s', ...}.

    `kind` 'steps': the timed steps only; 'startup': the whole process. Returns
    {'error': ...} when the profiled job fails, so the report says so.
    """
    with tempfile.TemporaryDirectory(prefix="bench-prof-") as tmp:
        if kind == "startup":
            prefix, env = ["-m", "cProfile", "-o", str(Path(tmp, "prof.rank{rank}"))], {}
        else:
            prefix, env = [], {"BENCH_PROFILE": str(Path(tmp, "prof"))}
        try:
            launch(script, world, opts, prefix=prefix, env=env, steps=PROFILE_STEPS)
        except JobError as e:
            return {"error": str(e)[-800:]}
        stats = pstats.Stats(str(Path(tmp, "prof.rank0")))
    funcs: dict[str, tuple[float, float]] = {}
    # (Stats.stats and .total_tt are the raw table pstats itself reads; the stubs leave them out)
    for (file, line, name), (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{_where(file)}:{line}({name})" if line else f"{name}"
        prev = funcs.get(key, (0.0, 0.0))
        funcs[key] = (prev[0] + tt, max(prev[1], ct))
    total_s = stats.total_tt  # type: ignore[attr-defined]
    return {"funcs": funcs, "total_s": total_s, "steps": PROFILE_STEPS, "kind": kind}


def _scope(profile: dict) -> str:
    if profile.get("kind") == "startup":
        return f"whole process (imports included), rank 0, {profile['steps']} timed steps"
    return f"timed steps only, rank 0, {profile['steps']} steps"


def excess_table(candidate: dict, baseline: dict, top: int = 12) -> str:
    """Functions whose own time is larger in `candidate` than in `baseline`."""
    if "error" in candidate or "error" in baseline:
        return "profile failed: " + (candidate.get("error") or baseline.get("error", ""))[-300:]
    rows = []
    for key, (tt, ct) in candidate["funcs"].items():
        base = baseline["funcs"].get(key, (0.0, 0.0))[0]
        rows.append((tt - base, tt, base, ct, key))
    rows.sort(reverse=True)
    own = sum(tt for key, (tt, _) in candidate["funcs"].items() if key.startswith("disttrain/"))
    lines = [
        f"{_scope(candidate)}: total {candidate['total_s']:.2f} s "
        f"vs {baseline['total_s']:.2f} s hand-written; in disttrain's own Python: "
        f"{own:.3f} s ({own / candidate['steps'] * 1e3:.2f} ms per step)",
        f"{'excess s':>9} {'own s':>8} {'base s':>8} {'cum s':>8}  function",
    ]
    for excess, tt, base, ct, key in rows[:top]:
        lines.append(f"{excess:9.3f} {tt:8.3f} {base:8.3f} {ct:8.3f}  {key}")
    return "\n".join(lines)


def top_table(profile: dict, top: int = 12, only: str = "") -> str:
    """The `top` functions by own time (optionally only those whose name contains `only`)."""
    if "error" in profile:
        return "profile failed: " + profile["error"][-300:]
    rows = sorted(((tt, ct, k) for k, (tt, ct) in profile["funcs"].items() if only in k), reverse=True)
    lines = [f"{_scope(profile)}: total {profile['total_s']:.2f} s", f"{'own s':>8} {'cum s':>8}  function"]
    lines += [f"{tt:8.3f} {ct:8.3f}  {k}" for tt, ct, k in rows[:top]]
    return "\n".join(lines)


def import_profile(stmt: str, top: int = 15) -> str:
    """Modules that STMT (an import statement) loads after `import torch`, by cumulative time."""
    r = run_python(f"import torch; {stmt}", args=["-X", "importtime"])
    if r.returncode != 0:
        return f"{stmt} failed: {r.stderr[-300:]}"
    rows, after_torch = [], False
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if not m:
            continue
        self_us, cum_us, indent, name = int(m[1]), int(m[2]), len(m[3]), m[4]
        if name == "torch" and indent == 1:
            after_torch = True
            continue
        if after_torch:
            rows.append((cum_us, self_us, indent, name))
    total = sum(c for c, _, i, _ in rows if i == 1)
    rows.sort(reverse=True)
    lines = [
        f"`python -X importtime -c 'import torch; {stmt}'`: {total / 1e6:.3f} s loaded after torch",
        f"{'cum ms':>8} {'self ms':>8}  module",
    ]
    lines += [f"{c / 1e3:8.1f} {s / 1e3:8.1f}  {n}" for c, s, _, n in rows[:top]]
    return "\n".join(lines)
