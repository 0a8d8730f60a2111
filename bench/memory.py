"""Section 4: per-rank tensor bytes under each strategy at w = 1, 2, 4 against the ideal.

Bytes are this rank's parameters + gradients + AdamW state after one step
(workloads/memory_probe.py), the largest rank reported. The ideals divide the
replicated (DDP) bytes measured at the same world size:

    ddp            P + G + O            (everything replicated)
    zero1          P + G + O / N        (optimizer state sharded)
    fsdp full      (P + G + O) / N      (ZeRO-3)
    fsdp grad_op   (P + G + O) / N      between steps; parameters stay gathered only
                                        from forward to backward
    fsdp hybrid    (P + G + O) / g      (g = shard group size)

At w = 1 every strategy is the unwrapped module, so all equal ddp. Bytes are exact
(no repeats needed): one launch per world size measures every strategy.
"""

from __future__ import annotations

from bench.common import JobError, Options, launch
from bench.matrix import Matrix

NAME = "memory"
TITLE = "4. Memory: per-rank tensor bytes against the ideal"
WORLDS = (1, 2, 4)
TARGET = ("fsdp:full", 4, 1.05)


def specs(world: int, strategies: set[str]) -> list[str]:
    out = ["ddp", "zero1"]
    if "fsdp" in strategies:
        out += ["fsdp:full", "fsdp:grad_op"] + (["fsdp:hybrid:2"] if world == 4 else [])
    return out


def ideal(spec: str, world: int, ddp: dict) -> int:
    if spec == "ddp" or world == 1:
        return ddp["total"]
    if spec == "zero1":
        return ddp["params"] + ddp["grads"] + ddp["optim"] // world
    if spec.startswith("fsdp:hybrid"):
        return ddp["total"] // int(spec.split(":")[2])
    return ddp["total"] // world


def jobs() -> list[tuple[str, int]]:
    return []


def analyse(matrix: Matrix, opts: Options, log=print) -> dict:
    rows, errors = [], {}
    for world in WORLDS:
        wanted = specs(world, matrix.strategies)
        log(f"  memory probe at world {world}: {', '.join(wanted)}")
        try:
            job = launch("memory_probe.py", world, opts, env={"BENCH_STRATEGIES": ",".join(wanted)})
        except JobError as e:
            errors[world] = str(e)[-1500:]
            continue
        largest = {s: max((r["bytes"][s] for r in job.ranks), key=lambda b: b["total"]) for s in wanted}
        for spec in wanted:
            b = largest[spec]
            want = ideal(spec, world, largest["ddp"])
            rows.append({"spec": spec, "world": world, **b, "ideal": want,
                         "ratio": b["total"] / want if want else None})
    target_row = next((r for r in rows if (r["spec"], r["world"]) == TARGET[:2]), None)
    return {"rows": rows, "errors": errors, "fsdp_note": matrix.fsdp_note,
            "target": {"spec": TARGET[0], "world": TARGET[1], "max_ratio": TARGET[2],
                       "ratio": target_row["ratio"] if target_row else None}}


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def render(data: dict) -> str:
    out = ["| strategy | world | params MiB | grads MiB | optimizer MiB | total MiB / rank | "
           "ideal MiB | total / ideal |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['spec']} | {r['world']} | {_mib(r['params'])} | {_mib(r['grads'])} | "
                   f"{_mib(r['optim'])} | {_mib(r['total'])} | {_mib(r['ideal'])} | "
                   f"{r['ratio']:.3f} |")
    for world, err in data["errors"].items():
        out.append(f"| (world {world}) | failed: {err.strip().splitlines()[-1][:150]} | | | | | | |")
    t = data["target"]
    out.append("")
    if data.get("fsdp_note"):
        out.append(f"fsdp rows pending: {data['fsdp_note']}")
    elif t["ratio"] is None:
        out.append(f"Target ({t['spec']} at w={t['world']} <= {t['max_ratio']} x ideal): no measurement.")
    else:
        verdict = "met" if t["ratio"] <= t["max_ratio"] else "MISSED"
        out.append(f"Target: {t['spec']} at w={t['world']} at most {t['max_ratio']} x ideal: "
                   f"**{verdict}** ({t['ratio']:.3f}).")
        if verdict == "MISSED":
            out.append("Why: the excess over the ideal is what the columns show: shards are "
                       "padded so that every rank's shard of a parameter has the same length, "
                       "and parameters that are not divisible by the world size (and scalar "
                       "optimizer state such as Adam's step) are padded or replicated.")
    return "\n".join(out)


def plot(data: dict, plt):
    if not data["rows"]:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for spec in dict.fromkeys(r["spec"] for r in data["rows"]):
        rs = [r for r in data["rows"] if r["spec"] == spec]
        ax.plot([r["world"] for r in rs], [r["total"] / 2**20 for r in rs], "o-", label=spec)
    ddp = [r for r in data["rows"] if r["spec"] == "ddp"]
    ax.plot([r["world"] for r in ddp], [r["total"] / 2**20 / r["world"] for r in ddp], "k--",
            label="ideal fsdp full (ddp / N)")
    ax.set_xlabel("world size")
    ax.set_ylabel("MiB per rank")
    ax.set_xticks(list(WORLDS))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
