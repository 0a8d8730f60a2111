"""Section 3: throughput at 1 and 2 ranks (1 thread each) against the ideal 2x.

Weak scaling: every rank keeps the same micro-batch, so 2 ranks process twice the
tokens per optimizer step. Efficiency = (tokens/s at 2 ranks) / (2 x tokens/s at
1 rank), paired within each repeat. At 1 rank `dt.wrap` leaves the module
unwrapped (no process group), so the baseline is the plain single-process loop,
which is what a user's script runs there. On a machine with 2 cores the 2-rank run
also competes with everything else that runs, which the load column shows.
"""

from __future__ import annotations

from typing import Any

from bench.common import Options, fmt
from bench.matrix import Matrix, paired
from bench.profiles import top_table

NAME = "scaling"
TITLE = "3. Scaling: 1 and 2 ranks against the ideal 2x"
STRATEGIES = {"ddp": "disttrain_ddp", "fsdp": "disttrain_fsdp"}
TARGET = {"ddp": 0.90}


def jobs() -> list[tuple[str, int]]:
    return [(name, w) for name in STRATEGIES.values() for w in (1, 2)]


def analyse(matrix: Matrix, opts: Options) -> dict:
    rows, profiles = [], {}
    for strategy, name in STRATEGIES.items():
        one, two = matrix.get(name, 1), matrix.get(name, 2)
        row: dict[str, Any] = {
            "strategy": strategy,
            "tps1": one.stat("tokens_per_s"),
            "tps2": two.stat("tokens_per_s"),
            "note": two.note() or one.note(),
        }
        if one.ok and two.ok:
            speedup = paired(two, one, "tokens_per_s")
            row["speedup"] = speedup
            row["efficiency"] = {k: (v / 2 if k != "n" else v) for k, v in speedup.items()}
            target = TARGET.get(strategy)
            row["missed"] = bool(target) and row["efficiency"]["median"] < target
            if row["missed"] and opts.profile:
                prof = matrix.profile(name, 2)
                if prof:
                    profiles[strategy] = top_table(prof)
        rows.append(row)
    return {
        "rows": rows,
        "profiles": profiles,
        "targets": TARGET,
        "jobs": [matrix.get(n, w).to_json() for n, w in jobs()],
    }


def render(data: dict) -> str:
    out = [
        "| strategy | tokens/s, 1 rank | tokens/s, 2 ranks | speedup (ideal 2.00) | efficiency | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "speedup" not in r:
            out.append(f"| {r['strategy']} | {r['note']} | | | | pending |")
            continue
        target = data["targets"].get(r["strategy"])
        verdict = (f">= {target}: " + ("MISSED" if r["missed"] else "met")) if target else "reported"
        out.append(
            f"| {r['strategy']} | {fmt(r['tps1'], digits=0)} | {fmt(r['tps2'], digits=0)} | "
            f"{fmt(r['speedup'], digits=2)} | {fmt(r['efficiency'], digits=2)} | {verdict} |"
        )
    for strategy, table in data.get("profiles", {}).items():
        out += [
            "",
            f"Where the 2-rank {strategy} job spends its time (cProfile, top own time; "
            f"time in gloo waits and in the other ranks' share of 2 cores shows here):",
            "",
            "```",
            table,
            "```",
        ]
    return "\n".join(out)


def plot(data: dict, plt):
    rows = [r for r in data["rows"] if "speedup" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tps1"]["median"] for r in rows], 0.2, label="1 rank")
    ax.bar(list(xs), [r["tps2"]["median"] for r in rows], 0.2, label="2 ranks")
    ax.bar([x + 0.2 for x in xs], [2 * r["tps1"]["median"] for r in rows], 0.2, label="ideal 2 ranks", color="#bbb")
    ax.set_xticks(list(xs), [r["strategy"] for r in rows])
    ax.set_ylabel("tokens / s")
    ax.legend()
    fig.tight_layout()
    return fig
