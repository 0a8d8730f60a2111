"""Section 2: disttrain against Hugging Face Accelerate and Lightning Fabric.

The same workload (bench/workloads/plain.py) converted to each framework, run at 2
gloo ranks on the CPU, 1 thread each: step time, time to first step, peak RSS per
rank, `import` time above `import torch` (from section 7's measurement) and the
lines of user code changed from the single-device script (`code_diff`). Ratios
are disttrain / peer within the same repeat: below 1 means disttrain is faster.
"""

from __future__ import annotations

from bench.code_diff import count_all
from bench.common import Options, fmt
from bench.imports import cached
from bench.matrix import Matrix, label, paired, script
from bench.profiles import top_table

NAME = "peers"
TITLE = "2. Against Hugging Face Accelerate and Lightning Fabric"
WORLD = 2
OURS = "disttrain_ddp"
PEERS = ["accelerate", "fabric"]
# Import cost each script pays (imports.MODULES rows); disttrain's import is lazy, so its
# row touches the names the script uses.
IMPORTS = {
    "disttrain_ddp": "disttrain, names a script uses",
    "accelerate": "accelerate",
    "fabric": "lightning.fabric",
    "torch_ddp": None,
}
CODE = ["torch_ddp", "torch_fsdp", "disttrain_ddp", "disttrain_fsdp", "disttrain_job", "accelerate", "fabric"]
JOB = "disttrain_job"  # dt.Job: lines only (its step is disttrain_ddp's plus the job's bookkeeping)


def jobs() -> list[tuple[str, int]]:
    return [(name, WORLD) for name in [OURS, *PEERS, "torch_ddp"]]


def analyse(matrix: Matrix, opts: Options) -> dict:
    ours = matrix.get(OURS, WORLD)
    code = count_all({name: script(name) for name in CODE})
    imports = cached(matrix, opts)
    rows, ratios, missed = [], [], []
    for name in [OURS, *PEERS, "torch_ddp"]:
        job = matrix.get(name, WORLD)
        module = IMPORTS[name]
        rows.append(
            {
                "name": name,
                "label": label(name),
                "note": job.note(),
                "runs": len(job.runs),
                "step_s": job.stat("step_s"),
                "first_step_s": job.stat("first_step_s"),
                "rss_mb": job.stat("rss_mb"),
                "import_s": imports.get(module, {}) if module else {},
                "changed": code[name]["changed"],
                "total": code[name]["total"],
            }
        )
    for peer in PEERS:
        job = matrix.get(peer, WORLD)
        if not (job.ok and ours.ok):
            ratios.append({"peer": peer, "pending": job.note() or ours.note()})
            continue
        r = {
            "peer": peer,
            "step_s": paired(ours, job, "step_s"),
            "first_step_s": paired(ours, job, "first_step_s"),
            "rss_mb": paired(ours, job, "rss_mb"),
            "code": code[OURS]["changed"] - code[peer]["changed"],
        }
        r["missed"] = [m for m in ("step_s", "first_step_s") if r[m]["median"] > 1.0] + (
            ["code"] if r["code"] >= 0 else []
        )
        missed += r["missed"]
        ratios.append(r)
    profile = ""
    if opts.profile and "step_s" in missed:
        prof = matrix.profile(OURS, WORLD, "steps")
        profile = top_table(prof) if prof else ""
    if opts.profile and "first_step_s" in missed:
        prof = matrix.profile(OURS, WORLD, "startup")
        profile += ("\n\n" if profile else "") + (top_table(prof) if prof else "")
    return {
        "world": WORLD,
        "rows": rows,
        "ratios": ratios,
        "profile": profile,
        "diffs": {k: v["diff"] for k, v in code.items()},
        "code": {k: {f: v[f] for f in ("added", "removed", "changed", "total")} for k, v in code.items()},
        "jobs": [matrix.get(n, WORLD).to_json() for n in [OURS, *PEERS, "torch_ddp"]],
    }


def render(data: dict) -> str:
    out = [
        "| framework (2 ranks, gloo) | s / step | s to first step | import s above torch | "
        "peak RSS / rank MiB | code lines changed | script lines |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        imp = fmt(row["import_s"]) if row["import_s"] else "0 (torch only)"
        if row["note"]:
            out.append(f"| {row['label']} | {row['note']} | | {imp} | | {row['changed']} | {row['total']} |")
            continue
        out.append(
            f"| {row['label']} | {fmt(row['step_s'], digits=4)} | "
            f"{fmt(row['first_step_s'], digits=2)} | {imp} | {fmt(row['rss_mb'], digits=0)} | "
            f"{row['changed']} | {row['total']} |"
        )
    out += [
        "",
        "Ratios disttrain / peer, paired within each repeat (targets: step time and "
        "time to first step <= 1, fewer changed lines):",
        "",
        "| peer | step time | time to first step | peak RSS | changed lines, disttrain - peer | targets |",
        "|---|---|---|---|---|---|",
    ]
    names = {"step_s": "step time", "first_step_s": "time to first step", "code": "code"}
    for r in data["ratios"]:
        if "pending" in r:
            out.append(f"| {label(r['peer'])} | {r['pending']} | | | | pending |")
            continue
        verdict = "met" if not r["missed"] else "MISSED: " + ", ".join(names[m] for m in r["missed"])
        out.append(
            f"| {label(r['peer'])} | {fmt(r['step_s'])} | {fmt(r['first_step_s'])} | "
            f"{fmt(r['rss_mb'])} | {r['code']:+d} | {verdict} |"
        )
    out += [
        "",
        "Lines changed are code lines only (no docstring, comments, blank lines; "
        "indentation ignored as by `git diff -w`), counted with `difflib` between "
        "bench/workloads/plain.py and each converted script. disttrain's count includes the "
        "lines its `Accumulator` removes from the hand-written loop.",
        "",
    ]
    out += job_line(data.get("code", {}))
    out += ["<details><summary>The diffs</summary>", ""]
    for name, diff in data["diffs"].items():
        out += [f"{label(name)}:", "", "```diff", diff, "```", ""]
    out += ["</details>"]
    if data.get("profile"):
        out += [
            "",
            "Where the disttrain job spends its time (cProfile, top own time):",
            "",
            "```",
            data["profile"],
            "```",
        ]
    return "\n".join(out)


def job_line(code: dict) -> list[str]:
    """The `dt.Job` conversion's count against HF Accelerate's, one sentence."""
    if JOB not in code or "accelerate" not in code:
        return []
    n, acc = code[JOB]["changed"], code["accelerate"]["changed"]
    return [
        f"The resumable conversion, `dt.Job` (bench/workloads/disttrain_job.py: checkpoints, "
        f"automatic resume with exactly-once data, SIGTERM handling, final save), changes "
        f"{n} lines: {n - acc:+d} against HF Accelerate's {acc}, whose script neither "
        f"checkpoints nor resumes ({'met' if n <= acc else 'MISSED'}).",
        "",
    ]


def plot(data: dict, plt):
    rows = [r for r in data["rows"] if not r["note"]]
    if not rows:
        return None
    metrics = [
        ("step_s", "s / step"),
        ("first_step_s", "s to first step"),
        ("rss_mb", "peak RSS / rank MiB"),
        ("changed", "code lines changed"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (metric, title) in zip(axes, metrics, strict=False):
        vals = [r[metric]["median"] if isinstance(r[metric], dict) else r[metric] for r in rows]
        ax.bar([r["name"] for r in rows], vals, color="#4878a8")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig
