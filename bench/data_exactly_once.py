"""Every sample once, end to end, on data from disk: the c10d scale-down/up scenario
of tests/faults/test_elastic.py (two agents, --nnodes 1:2; kill -9 of one node mid-epoch, the
survivor goes on at world 1, a new agent joins: world 2 again) with `[data] tokens`
(token files from `disttrain data prepare`) or `[data] hf_dataset` (a save_to_disk
folder) instead of the stdlib corpus.

    python bench/data_exactly_once.py [--sources tokens,hf] [--strategies ddp,fsdp]

One epoch of 384 windows of 33 bytes, 8 per step, 48 steps; the sample audit
(elastic.record_samples) must show each index on the final timeline exactly once.
Writes bench/results/data_exactly_once.md. About 75 s per cell on 2 cores; not in the
test suite (tests/unit/test_token_data.py checks the same arithmetic in-process).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from elastic_helpers import audit_timeline, kill_node, metrics, start, trainer_cmd, wait_for  # noqa: E402

from disttrain.data.prepare import prepare  # noqa: E402
from disttrain.launch.etcd_server import free_port  # noqa: E402

SLOW = "delay@step:ms=300"  # the scale events land mid-epoch
WINDOWS, BLOCK = 384, 32


def make_source(kind: str, root: Path) -> str:
    """The --data.* override for `kind`, after writing its files under `root`."""
    text = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    train, val = text[: WINDOWS * BLOCK + 1], text[200_000:202_000]
    if kind == "tokens":
        (root / "texts").mkdir()
        (root / "texts" / "train.txt").write_bytes(train)
        (root / "texts" / "val.txt").write_bytes(val)
        prepare([root / "texts" / "train.txt", root / "texts" / "val.txt"], root / "tokens", progress=False)
        return f"--data.tokens={root / 'tokens'}"
    import datasets

    def rows(b):
        return [list(b[i * BLOCK : i * BLOCK + BLOCK + 1]) for i in range((len(b) - 1) // BLOCK)]

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": rows(train)}),
            "validation": datasets.Dataset.from_dict({"input_ids": rows(val)}),
        }
    ).save_to_disk(str(root / "hf"))
    return f"--data.hf_dataset={root / 'hf'}"


def scenario(source: str, strategy: str, out: Path) -> dict:
    flags = (
        "--nnodes",
        "1:2",
        "--nproc",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        f"job-{out.name}",
        "--max-restarts",
        "10",
    )
    cmd = trainer_cmd(
        out, "--train.steps=48", source, f"--parallel.strategy={strategy}", "--checkpoint.every=2", run_flags=flags
    )
    out.mkdir(parents=True)
    logs = [out / f"agent{i}.txt" for i in range(3)]

    def progressed(w, b):
        return any(m["world_size"] == w and m["step"] > b for m in metrics(out))

    agents = [start(cmd, logs[0], DISTTRAIN_FAULT=SLOW)]
    try:
        time.sleep(1.0)  # the first agent hosts the c10d store
        agents.append(start(cmd, logs[1], DISTTRAIN_FAULT=SLOW))
        wait_for(lambda: progressed(2, 4), 300, "world 2", logs)
        mark = max(m["step"] for m in metrics(out))
        kill_node(agents[1])
        wait_for(lambda: progressed(1, mark + 2), 300, "world 1 after the kill", logs)
        mark = max(m["step"] for m in metrics(out) if m["world_size"] == 1)
        agents.append(start(cmd, logs[2], DISTTRAIN_FAULT=SLOW))
        wait_for(lambda: progressed(2, mark), 300, "world 2 after the join", logs)
        codes = [agents[0].wait(timeout=400), agents[2].wait(timeout=400)]
    finally:
        for a in agents:
            kill_node(a)
    counts = Counter(i for s in audit_timeline(out).values() for i in s)
    worlds = [m["world_size"] for m in metrics(out)]
    return {
        "exit": codes,
        "samples": len(counts),
        "max_count": max(counts.values()),
        "missing": WINDOWS - len(set(counts) & set(range(WINDOWS))),
        "worlds": "->".join(str(w) for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", default="tokens,hf")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "data_exactly_once.md"))
    args = ap.parse_args()
    lines = [
        "## Every sample once on data from disk (kill -9 of a node, world 2 -> 1 -> 2)",
        "",
        f"`python bench/data_exactly_once.py --sources {args.sources} --strategies {args.strategies}`: "
        f"{WINDOWS} samples, 48 steps of 8; the final timeline of the sample audit.",
        "",
        "| source | strategy | worlds | samples seen | missing | most times one was seen | exit |",
        "|---|---|---|---|---|---|---|",
    ]
    ok = True
    for kind in args.sources.split(","):
        for strategy in args.strategies.split(","):
            with tempfile.TemporaryDirectory(prefix="exactly_once_") as tmp:
                r = scenario(make_source(kind, Path(tmp)), strategy, Path(tmp) / f"{kind}_{strategy}")
            ok &= r["missing"] == 0 and r["max_count"] == 1 and r["exit"] == [0, 0]
            lines.append(
                f"| {kind} | {strategy} | {r['worlds']} | {r['samples']} | {r['missing']} "
                f"| {r['max_count']} | {r['exit']} |"
            )
            print(lines[-1], flush=True)
    Path(args.results).write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
