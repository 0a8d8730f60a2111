"""Section 1: disttrain against the same training written by hand in bare PyTorch.

The same GPT, data, batch, accumulation (2 micro-steps) and clipping, once with
`DistributedDataParallel` / FSDP2 `fully_shard` written out, once with `dt.wrap`,
`dt.Accumulator` and `dt.DistributedSampler` (bench/workloads/*.py). Compared at
2 gloo ranks, 1 thread each: seconds per optimizer step, seconds from process start
to the end of the first step, and peak RSS of the largest rank. The ratios are
disttrain / hand-written within the same repeat.
"""

from __future__ import annotations

from typing import Any

from bench.common import Options, fmt, variant_table
from bench.matrix import JobResult, Matrix, label, paired
from bench.profiles import excess_table

NAME = "overhead"
TITLE = "1. Overhead against hand-written PyTorch"
WORLD = 2
PAIRS = [("ddp", "torch_ddp", "disttrain_ddp"), ("fsdp", "torch_fsdp", "disttrain_fsdp")]
TARGETS = {"step_s": 1.02, "first_step_s": 1.10}
METRIC_NAMES = {"step_s": "step time", "first_step_s": "time to first step"}


def jobs() -> list[tuple[str, int]]:
    return [(name, WORLD) for _, base, cand in PAIRS for name in (base, cand)]


def _job_row(job: JobResult) -> dict:
    return {
        "key": job.key,
        "label": label(job.name),
        "note": job.note(),
        "step_s": job.stat("step_s"),
        "first_step_s": job.stat("first_step_s"),
        "rss_mb": job.stat("rss_mb"),
        "runs": len(job.runs),
    }


def analyse(matrix: Matrix, opts: Options) -> dict:
    rows, ratios, profiles = [], [], {}
    for strategy, base_name, cand_name in PAIRS:
        base, cand = matrix.get(base_name, WORLD), matrix.get(cand_name, WORLD)
        rows += [_job_row(base), _job_row(cand)]
        if not (base.ok and cand.ok):
            ratios.append({"strategy": strategy, "pending": cand.note() or base.note()})
            continue
        r: dict[str, Any] = {
            "strategy": strategy,
            **{m: paired(cand, base, m) for m in ("step_s", "first_step_s", "rss_mb")},
        }
        r["missed"] = [m for m, t in TARGETS.items() if r[m]["median"] > t]
        ratios.append(r)
        for metric in r["missed"] if opts.profile else []:
            kind = "steps" if metric == "step_s" else "startup"
            prof_c, prof_b = matrix.profile(cand_name, WORLD, kind), matrix.profile(base_name, WORLD, kind)
            if prof_c and prof_b:
                profiles[f"{strategy} {METRIC_NAMES[metric]}"] = excess_table(prof_c, prof_b)
    return {
        "world": WORLD,
        "rows": rows,
        "ratios": ratios,
        "profiles": profiles,
        "jobs": [j.to_json() for j in (matrix.get(n, WORLD) for _, b, c in PAIRS for n in (b, c))],
    }


def render(data: dict) -> str:
    out = [
        "These are thin user-loop scripts (`dt.wrap`, `dt.Accumulator`, the sampler): the "
        "trainer behind `disttrain train`, with its guard, preemption vote, audit, evaluations "
        "and checkpoints, is measured against the same work by hand in section 1b.",
        "",
    ]
    out += variant_table(
        "variant (2 ranks, gloo, 1 thread each)",
        [("s / step", "step_s", 4), ("s to first step", "first_step_s", 2), ("peak RSS / rank MiB", "rss_mb", 0)],
        data["rows"],
    )
    out += [
        "",
        "Ratios disttrain / hand-written, paired within each repeat "
        "(targets: step time <= 1.02, time to first step <= 1.10):",
        "",
        "| strategy | step time | time to first step | peak RSS | targets |",
        "|---|---|---|---|---|",
    ]
    for r in data["ratios"]:
        if "pending" in r:
            out.append(f"| {r['strategy']} | {r['pending']} | | | pending |")
            continue
        verdict = "met" if not r["missed"] else "MISSED: " + ", ".join(METRIC_NAMES[m] for m in r["missed"])
        out.append(
            f"| {r['strategy']} | {fmt(r['step_s'])} | {fmt(r['first_step_s'])} | {fmt(r['rss_mb'])} | {verdict} |"
        )
    for what, table in data.get("profiles", {}).items():
        out += [
            "",
            f"Why {what} misses (cProfile, functions where disttrain spends more own time than the hand-written job):",
            "",
            "```",
            table,
            "```",
        ]
    return "\n".join(out)


def plot(data: dict, plt):
    rows = [r for r in data["rows"] if not r["note"]]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, metric, title in (
        (axes[0], "step_s", "seconds per step"),
        (axes[1], "first_step_s", "seconds to first step"),
    ):
        med = [r[metric]["median"] for r in rows]
        err = [
            [m - r[metric]["min"] for m, r in zip(med, rows, strict=False)],
            [r[metric]["max"] - m for m, r in zip(med, rows, strict=False)],
        ]
        ax.barh([r["label"] for r in rows], med, xerr=err, color="#4878a8")
        ax.set_title(title + " (median, min-max)")
        ax.invert_yaxis()
    fig.tight_layout()
    return fig
