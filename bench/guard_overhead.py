"""Section 1b: the product's overhead: `disttrain train` against a hand-written loop
that does the same work, and each feature's share from an end-to-end A/B.

Both sides run bench/workloads/train_spec.py's job at 2 gloo ranks, 1 thread each: the
tiny GPT of section 1, 8 sequences per rank, a logged (all-reduced) loss every 10 steps,
5 x `--steps` timed steps (100 by default) with an evaluation and a checkpoint at half
and at the end of them. The baseline
(workloads/hand_train.py) is DDP, DistributedSampler, AdamW, warmup-cosine, clipping,
evaluation and a plain DCP save written out; the product (workloads/trainer_run.py) is
one rank of `disttrain train` with every default on, the sample audit switched on
(elastic.record_samples) and the same cadence. The figure is seconds per step from the
log line of step 10 to that of the last step, evaluations and checkpoints included.

Each feature's share comes from launches of the whole job with that feature switched
off through its config key, in the same interleaved repeats (bench/matrix.py rotates
the order each repeat), so every share is a ratio of two runs minutes apart, never a
sum of separately timed pieces. The preemption vote has no config key: its cost is
measured as the same all-reduce per step added to the hand-written loop.
"""

from __future__ import annotations

from bench.common import Options, fmt
from bench.matrix import Matrix, label, paired

NAME = "product"
TITLE = "1b. The product's overhead: `disttrain train` against the same work by hand"
WORLD = 2
BASE, FULL = "hand_train", "dt_train"
TARGET = 1.03
# (feature, job with it, job without it, how it is switched off)
FEATURES = [
    ("guard: launch checks, heartbeats, watchdog, replica checksum (each checkpoint step)",
     FULL, "dt_train_no_guard", "guard.enabled=false"),
    ("sample audit (each rank appends its sample indices)", FULL, "dt_train_no_audit",
     "elastic.record_samples=false"),
    ("checkpoints, disttrain (DCP, sha256 manifest, atomic commit, retention)", FULL,
     "dt_train_no_ckpt", "checkpoint.enabled=false"),
    ("checkpoints, hand-written (plain dcp.save, retention)", BASE, "hand_train_no_ckpt",
     "BENCH_TRAIN_CKPT=0 (the script's switch)"),
    ("preemption vote: one all-reduce per step, in the hand-written loop", "hand_train_vote",
     BASE, "no config key in the trainer: measured on the baseline (BENCH_VOTE=1)"),
]
JOBS = [BASE, FULL, "dt_train_no_guard", "dt_train_no_audit", "dt_train_no_ckpt",
        "hand_train_no_ckpt", "hand_train_vote"]


def jobs() -> list[tuple[str, int]]:
    return [(name, WORLD) for name in JOBS]


def analyse(matrix: Matrix, opts: Options) -> dict:
    rows = []
    for name in JOBS:
        job = matrix.get(name, WORLD)
        rows.append({"name": name, "label": label(name), "note": job.note(),
                     "step_s": job.stat("step_s"), "rss_mb": job.stat("rss_mb"), "runs": len(job.runs)})
    base, full = matrix.get(BASE, WORLD), matrix.get(FULL, WORLD)
    ratio = paired(full, base, "step_s") if base.ok and full.ok else {}
    shares = []
    for feature, on, off, switch in FEATURES:
        a, b = matrix.get(on, WORLD), matrix.get(off, WORLD)
        s = paired(a, b, "step_s") if a.ok and b.ok else {}
        shares.append({"feature": feature, "switch": switch, "ratio": s,
                       "note": "" if s else (a.note() or b.note() or "no paired repeats")})
    return {"world": WORLD, "rows": rows, "ratio": ratio, "shares": shares, "target": TARGET,
            "timed_steps": 5 * max(2, opts.steps), "jobs": [matrix.get(n, WORLD).to_json() for n in JOBS]}


def extra_files(data: dict, results) -> None:
    """Written with the report: bench/results/guard.md, which docs/guard.md cites."""
    (results / "guard.md").write_text(guard_md(data) + "\n")


def _pct(s: dict) -> str:
    if not s:
        return "n/a"
    return (f"{(s['median'] - 1) * 100:+.1f} % ({(s['min'] - 1) * 100:+.1f} to "
            f"{(s['max'] - 1) * 100:+.1f}), n={s['n']}")


def render(data: dict) -> str:
    out = ["| variant (2 ranks, gloo, 1 thread each) | s / step, evals and checkpoints "
           "included | peak RSS / rank MiB | runs |", "|---|---|---|---|"]
    for r in data["rows"]:
        if r["note"]:
            out.append(f"| {r['label']} | {r['note']} | | 0 |")
        else:
            out.append(f"| {r['label']} | {fmt(r['step_s'], digits=4)} | "
                       f"{fmt(r['rss_mb'], digits=0)} | {r['runs']} |")
    out += ["", "Each feature's share: step time with it / without it, paired within each "
            "repeat (median, min to max):", "",
            "| feature | switched off by | added step time |", "|---|---|---|"]
    for s in data["shares"]:
        out.append(f"| {s['feature']} | {s['switch']} | {s['note'] or _pct(s['ratio'])} |")
    out.append("")
    r = data["ratio"]
    if not r:
        out.append(f"Target (disttrain train / hand-written <= {data['target']}): no paired "
                   "measurement.")
        return "\n".join(out)
    verdict = "met" if r["median"] <= data["target"] else "MISSED"
    out.append(f"Target: `disttrain train` / hand-written step time at most {data['target']} "
               f"with every guard on: **{verdict}** ({fmt(r)}, n={r['n']}).")
    if verdict == "MISSED":
        out.append("")
        out.append(_where(data))
    return "\n".join(out)


def _where(data: dict) -> str:
    """The miss split into the measured shares and what they leave unexplained."""
    excess = data["ratio"]["median"] - 1
    med = {s["feature"].split(":")[0].split(" (")[0]: s["ratio"]["median"] - 1
           for s in data["shares"] if s["ratio"]}
    parts = [f"{k} {v * 100:+.1f} %" for k, v in med.items()]
    explained = sum(v for k, v in med.items() if k not in ("checkpoints, hand-written",))
    explained -= med.get("checkpoints, hand-written", 0.0)
    return (f"Where the {excess * 100:+.1f} % goes (medians of the A/B above, each relative to "
            f"its own 'off' run): {'; '.join(parts)}. Guard, audit, the vote and disttrain's "
            f"checkpoints less the hand-written ones account for {explained * 100:+.1f} %; the "
            f"rest ({(excess - explained) * 100:+.1f} %) is the loop itself (the DataLoader over "
            "an index-carrying dataset and the ElasticSampler, the Accumulator, the per-step "
            "dropout reseed, progress and metrics) and the noise of a shared machine.")


def guard_md(data: dict) -> str:
    """bench/results/guard.md: the guard's cost from the end-to-end A/B (docs/guard.md)."""
    guard = data["shares"][0]
    return "\n".join([
        "## Guard overhead (end-to-end A/B)", "",
        f"Command: `{data['command']}` (section {NAME}).", "",
        "`disttrain train` with the default guard (launch checks, heartbeats, the hang "
        "watchdog thread, a replica checksum at every checkpoint step: at least as often as "
        "the default 100) against the same run with "
        "`guard.enabled=false`, whole launches interleaved with the other variants of "
        f"section 1b, paired within each repeat; 2 gloo ranks on the CPU, "
        f"{data.get('timed_steps', 100)} timed steps with evaluations and checkpoints. This "
        "replaces the earlier sum of separately timed pieces.", "",
        "| measure | value |", "|---|---|",
        f"| step time, guard on / off | {guard['note'] or fmt(guard['ratio'], digits=4)} |",
        f"| added step time (median, min to max) | {guard['note'] or _pct(guard['ratio'])} |",
        "", "Goal (issue 6): at most 1 % of step time: "
        + ("no measurement." if not guard["ratio"] else
           ("**met**." if guard["ratio"]["median"] <= 1.01 else
            "**MISSED** on the median; see the spread: on a shared 2-core machine the "
            "repeat-to-repeat noise is of the same size."))])


def plot(data: dict, plt):
    rows = [r for r in data["rows"] if not r["note"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    med = [r["step_s"]["median"] for r in rows]
    err = [[m - r["step_s"]["min"] for m, r in zip(med, rows)],
           [r["step_s"]["max"] - m for m, r in zip(med, rows)]]
    ax.barh([r["label"] for r in rows], med, xerr=err, color="#4878a8")
    ax.set_title("seconds per step, evals and checkpoints included (median, min-max)")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig
