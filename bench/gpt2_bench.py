"""The GPT-2 124M shape through `disttrain train` on 2 CPU ranks against the same work
written by hand (bench/gpt2_by_hand.py): step time per strategy (ddp, fsdp) with compile
off and on, the measured training memory against `disttrain plan`, the checkpoint size.

    python bench/gpt2_bench.py [--steps 6] [--block 256] [--pairs 2] [--strategies ddp,fsdp]
        [--compile off] [--memory] [--raw RUNS.jsonl] [--until HH:MM]

Token files come from `disttrain data prepare` over the standard library's top-level
.py files (bytes), as examples/gpt2_124m.toml describes. For each strategy and compile
setting the launches alternate, product then hand-written (A B A B, `--pairs` pairs):
`disttrain train examples/gpt2_124m.toml` with `--steps` optimizer steps of one
sequence per rank, and `torchrun --nproc-per-node 2 bench/gpt2_by_hand.py` with the
same OMP_NUM_THREADS that `disttrain run` sets (cores // ranks). A launch's step time
is the median of the slowest rank's steps after the first two and before the last
(the product evaluates at its last step); each pair gives product / hand.
`--memory` adds one hand-written launch per strategy with a profiled step (torch's
memory profiler), compared with `disttrain plan`'s components. Every launch is one
line of `--raw` (JSON); `--render-only` rewrites the table from it.
Writes bench/results/gpt2.md (merged into BENCHMARKS.md by `python -m bench
--report-only`). Not part of the test suite: on a 2-core machine one launch takes minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "gpt2_124m.toml"
BY_HAND = ROOT / "bench" / "gpt2_by_hand.py"


def run(cmd: list[str], timeout: float = 3600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {}))
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def disttrain(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "disttrain.cli", *args], timeout=timeout)


def prepare_tokens(out: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    disttrain("data", "prepare", *map(str, sorted(stdlib.glob("*.py"))), "--out", str(out), "--quiet")
    return out


def steady(times: list[float]) -> float:
    """Median of the steps after the first two and before the last (or of all, when short)."""
    return statistics.median(times[2:-1] or times)


def shape_args(shape: str) -> list[str]:
    return [f"--model.{kv}" for kv in shape.split(",") if kv]


def product_launch(a, tokens: Path, out: Path, strategy: str, compile: bool) -> dict:
    """One `disttrain train`; its step times per rank, peak RSS and checkpoint bytes."""
    disttrain(
        "train",
        str(CONFIG),
        f"--data.tokens={tokens}",
        f"--parallel.strategy={strategy}",
        f"--train.compile={str(compile).lower()}",
        f"--train.steps={a.steps}",
        "--train.batch_size=1",
        "--train.accum_steps=1",
        f"--model.block_size={a.block}",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--train.log_every=1",
        f"--checkpoint.every={a.steps}",
        "--checkpoint.every_s=0",
        f"--train.out_dir={out}",
        *shape_args(a.shape),
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ckpt = (
        sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file())
        if (out / "checkpoints").exists()
        else 0
    )
    shutil.rmtree(out)  # 1.6 GB of checkpoint per launch at full size
    return {
        "step_time_max_s": [r["step_time_max_s"] for r in rows],
        "peak_mb": max(max(r["peak_mem_mb"]) for r in rows),
        "ckpt_bytes": ckpt,
    }


def hand_launch(a, tokens: Path, out: Path, strategy: str, compile: bool, memory: bool = False) -> dict:
    """One torchrun of bench/gpt2_by_hand.py with the threads `disttrain run` sets."""
    result = out.with_suffix(".json")
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(BY_HAND),
            "--strategy",
            strategy,
            "--tokens",
            str(tokens),
            "--steps",
            str(a.steps),
            "--block",
            str(a.block),
            "--out",
            str(result),
            *(["--shape", a.shape] if a.shape else []),
            *(["--compile"] if compile else []),
            *(["--memory", "--steps", "2"] if memory else []),
        ],
        env={"OMP_NUM_THREADS": threads, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    return json.loads(result.read_text())


def planned(strategy: str, block: int, shape: str) -> dict:
    """`disttrain plan`'s per-rank components for the bench's shape with checkpointing."""
    gpt = (
        str(CONFIG)
        if not shape
        else ",".join(
            [f"{k}={v}" for k, v in _toml_model().items() if k in ("vocab_size", "n_layer", "n_head", "n_embd")]
            + [shape]
        )
    )
    proc = disttrain(
        "plan",
        "--gpt",
        gpt,
        "--devices",
        "2",
        "--batch",
        "1",
        "--seq-len",
        str(block),
        "--accum-steps",
        "1",
        "--format",
        "json",
        timeout=300,
    )
    plans = {s["key"]: s for s in json.loads(proc.stdout)["strategies"]}
    base = "fsdp_full" if strategy == "fsdp" else strategy  # the example's sharding
    return plans[f"{base}+ac"]


def _toml_model() -> dict:
    import tomllib

    return tomllib.loads(CONFIG.read_text())["model"]


PROBE = (
    "import time, torch; torch.set_num_threads(1); a, b = torch.randn(256, 768), torch.randn(768, 3072); "
    "a @ b; t = time.perf_counter(); [a @ b for _ in range(20)]; "
    "print(20 * 2 * 256 * 768 * 3072 / (time.perf_counter() - t) / 1e9)"
)
"""One core's fp32 matmul rate at the model's shapes (GFLOP/s), to read the step times by."""


def flops_per_token(shape: str) -> float:
    """Matmul FLOPs per token of one training step with activation checkpointing: 6 per
    weight (forward, two backward products) for the blocks and the LM head, plus one
    more forward of the blocks (2 per weight); attention's own products left out."""
    m = {**_toml_model(), **{k: int(v) for k, v in (kv.split("=") for kv in shape.split(",") if kv)}}
    blocks, head = 12 * m["n_embd"] ** 2 * m["n_layer"], m["vocab_size"] * m["n_embd"]
    return 6 * (blocks + head) + 2 * blocks


def campaign(a, tokens: Path, tmp: Path, raw: Path) -> None:
    """The launches, A B A B per (strategy, compile), appended to `raw` one per line."""
    deadline = _deadline(a.until)
    gflops = float(run([sys.executable, "-c", PROBE], timeout=120).stdout.split()[-1])
    last: dict[str, float] = {}
    # eager before compiled; within each, pair 1 of every strategy before pair 2
    jobs = [
        (s, c == "on", i, kind)
        for c in a.compile.split(",")
        for i in range(a.first_pair, a.first_pair + a.pairs)
        for s in a.strategies.split(",")
        for kind in ("product", "hand")
    ]
    jobs += [(s, False, 0, "memory") for s in a.strategies.split(",")] if a.memory else []
    for n, (strategy, compile, pair, kind) in enumerate(jobs):
        guess = last.get(f"{kind}{compile}", 1.5 * last.get(f"{kind}False", 0.0))
        if deadline and time.time() + guess > deadline:
            print(f"skipped {kind} {strategy} compile={compile} pair {pair}: past --until", flush=True)
            continue
        start, load0 = time.time(), os.getloadavg()[0]
        out = tmp / f"{n}_{kind}_{strategy}_{int(compile)}"
        if kind == "product":
            row = product_launch(a, tokens, out, strategy, compile)
        else:
            row = hand_launch(a, tokens, out, strategy, compile, memory=kind == "memory")
        if kind == "memory":
            row["plan"] = planned(strategy, a.block, a.shape)
        row.update(
            command=a.command,
            sgemm_gflops=gflops,
            kind=kind,
            strategy=strategy,
            compile=compile,
            pair=pair,
            block=a.block,
            steps=a.steps,
            shape=a.shape,
            wall_s=time.time() - start,
            load_start=load0,
            load_end=os.getloadavg()[0],
            started=datetime.datetime.fromtimestamp(start).strftime("%H:%M:%S"),
        )
        last[f"{kind}{compile}"] = row["wall_s"]
        with raw.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            kind, strategy, compile, pair, f"{row['wall_s']:.0f}s", json.dumps(row.get("step_time_max_s")), flush=True
        )


def _deadline(until: str) -> float:
    if not until:
        return 0.0
    now = datetime.datetime.now()
    h, m = map(int, until.split(":"))
    return now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()


def timing_lines(rows: list[dict]) -> list[str]:
    """One line per pair: product and hand steps, their ratio; a line per cell's median."""
    lines = [
        "| strategy | compile | pair | disttrain train (s) | by hand (s) | train / hand "
        "| first step train / hand (s) | load (start, end) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells: dict = {}
    for r in rows:
        if r["kind"] in ("product", "hand"):
            cells.setdefault((r["strategy"], r["compile"]), {}).setdefault(r["pair"], {})[r["kind"]] = r
    summary = {}
    for (strategy, compile), pairs in cells.items():
        ratios = []
        for pair, both in sorted(pairs.items()):
            p, h = both.get("product"), both.get("hand")
            ps, hs = (steady(x["step_time_max_s"]) if x else None for x in (p, h))
            ratio = ps / hs if ps and hs else None
            ratios += [ratio] if ratio else []
            first = "/".join(f"{x['step_time_max_s'][0]:.1f}" if x else "-" for x in (p, h))
            loads = ", ".join(f"{x['load_start']:.1f}-{x['load_end']:.1f}" for x in (p, h) if x)
            lines.append(
                f"| {strategy} | {'on' if compile else 'off'} | {pair + 1} | {_f(ps)} | {_f(hs)} "
                f"| {_f(ratio, 3)} | {first} | {loads} |"
            )
        summary[(strategy, compile)] = {
            "ratio": statistics.median(ratios) if ratios else None,
            "product": _median_of(pairs, "product"),
            "hand": _median_of(pairs, "hand"),
        }
    return lines + [""] + summary_lines(summary)


def _median_of(pairs: dict, kind: str) -> float | None:
    values = [steady(b[kind]["step_time_max_s"]) for b in pairs.values() if kind in b]
    return statistics.median(values) if values else None


def _f(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def summary_lines(summary: dict) -> list[str]:
    lines = [
        "| strategy | compile | train / hand (median of pairs) | train step (s) | hand step (s) "
        "| compiled / eager (train) | compiled / eager (hand) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (strategy, compile), s in summary.items():
        eager = summary.get((strategy, False), {})
        ce = [_f(s[k] / eager[k]) if compile and s[k] and eager.get(k) else "-" for k in ("product", "hand")]
        lines.append(
            f"| {strategy} | {'on' if compile else 'off'} | {_f(s['ratio'], 3)} | {_f(s['product'])} "
            f"| {_f(s['hand'])} | {ce[0]} | {ce[1]} |"
        )
    return lines


def phase_lines(rows: list[dict]) -> list[str]:
    """Where a hand-written step goes (rank 0, median over the steady steps of every
    hand-written launch of the cell)."""
    lines = [
        "| strategy | compile | forward (s) | backward (s) | clip (s) | optimizer step (s) |",
        "|---|---|---|---|---|---|",
    ]
    cells: dict = {}
    for r in rows:
        if r["kind"] == "hand":
            cells.setdefault((r["strategy"], r["compile"]), []).extend(r["phases_rank0"][2:-1] or r["phases_rank0"])
    for (strategy, compile), ph in cells.items():
        med = {k: statistics.median(p[k] for p in ph) for k in ("forward", "backward", "clip", "optimizer")}
        lines.append(
            f"| {strategy} | {'on' if compile else 'off'} | {med['forward']:.2f} "
            f"| {med['backward']:.2f} | {med['clip']:.2f} | {med['optimizer']:.2f} |"
        )
    return lines


def flops_lines(rows: list[dict]) -> list[str]:
    """What the step costs in arithmetic, against one core's matmul rate."""
    hand = [steady(r["step_time_max_s"]) for r in rows if r["kind"] == "hand" and not r["compile"]]
    if not hand or "sgemm_gflops" not in rows[0]:
        return []
    r0 = rows[0]
    flops = flops_per_token(r0.get("shape", "")) * r0["block"]
    rate = flops / statistics.median(hand) / 1e9
    return [
        f"Why a step takes this long: one step is about {flops / 1e9:.0f} GFLOP of matmuls per rank "
        f"({r0['block']} tokens x {flops_per_token(r0.get('shape', '')) / 1e6:.0f} MFLOP: 6 per "
        f"weight for forward and backward, 2 more per block weight for the recomputed forward of "
        f"activation checkpointing; the 50304 x 768 LM head is a quarter of it), and each rank has "
        f"one core (OMP_NUM_THREADS=1), whose fp32 matmul runs at {r0['sgemm_gflops']:.0f} GFLOP/s "
        f"here (measured before the first launch). The eager hand-written step runs at "
        f"{rate:.0f} GFLOP/s per rank, all phases included: the step time is this machine's "
        f"arithmetic, not a cost of the loop around it.",
        "",
    ]


def tied_note(mem: dict) -> str:
    m = {**_toml_model(), **{k: int(v) for k, v in (kv.split("=") for kv in mem.get("shape", "").split(",") if kv)}}
    one = m["vocab_size"] * m["n_embd"] * 4 / 2**20
    return (
        f"Where the plan falls short: torch's memory timeline by category (which runs on the DDP "
        f"step; its data-flow pass fails on FSDP2's) puts the forward + backward peak at the end of "
        f"backward, when the activations are already freed: three {m['vocab_size']} x {m['n_embd']} "
        f"fp32 tensors ({3 * one:.0f} MB: the tied embedding / LM-head weight's gradient from the "
        f"head, its dense gradient from the embedding, their sum) above the state. The plan counts "
        f"that weight's gradient once; its activations term is the blocks' checkpointed inputs, one "
        f"block recomputed and the logits with their log-softmax."
    )


def memory_lines(rows: list[dict]) -> list[str]:
    """Plan against measured, per rank (MB = 2^20 bytes), rank 0's measurement."""
    mb = 2**20
    lines = [
        "| strategy | params plan / measured | grads | optimizer state | activations + buffers "
        "| total plan | total measured | plan / measured | optimizer-step peak | peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] != "memory":
            continue
        m, p = r["memory"][0], r["plan"]
        plan_act = p["activations"] + p["buffers"]
        plan_total = p["params"] + p["grads"] + p["optim"] + plan_act
        lines.append(
            f"| {r['strategy']} | {p['params'] / mb:.0f} / {m['params'] / mb:.0f} "
            f"| {p['grads'] / mb:.0f} / {m['grads'] / mb:.0f} | {p['optim'] / mb:.0f} / {m['optim'] / mb:.0f} "
            f"| {plan_act / mb:.0f} / {m['above_state_fwd_bwd'] / mb:.0f} | {plan_total / mb:.0f} "
            f"| {m['peak_fwd_bwd'] / mb:.0f} | {plan_total / m['peak_fwd_bwd']:.3f} "
            f"| {m['peak_optimizer'] / mb:.0f} | {m['peak_rss_mb']:.0f} |"
        )
    return lines


def render(rows: list[dict], command: str) -> str:
    timed = [r for r in rows if r["kind"] != "memory"] or rows
    r0, first, end = timed[0], timed[0], timed[-1]
    product = [r for r in rows if r["kind"] == "product"]
    lines = [
        "## GPT-2 124M on 2 CPU ranks: disttrain train against the same loop by hand",
        "",
        f"`{command}` (hand-written loop: bench/gpt2_by_hand.py under `torchrun --nproc-per-node 2`). "
        f"{r0['steps']} steps of 1 x {r0['block']} tokens per rank, activation checkpointing per block, "
        f"AdamW, grad clip 1.0, OMP_NUM_THREADS = cores / ranks in both. Launches alternate "
        f"train, hand, train, hand; a launch's step is the median of the slowest rank's steps "
        f"3 to {r0['steps'] - 1} (the first two compile and warm up, the last holds the "
        f"product's final evaluation and is left out of both). Load average (1 min) from "
        f"{first['load_start']:.2f} at the first launch ({first['started']}) to "
        f"{end['load_end']:.2f} after the last (started {end['started']}).",
        "",
    ]
    lines += timing_lines(rows) + [""]
    lines += [
        "Where the hand-written step goes (rank 0; backward includes the recomputed forward of "
        "activation checkpointing and the gradient all-reduce or reduce-scatter):",
        "",
    ]
    lines += phase_lines(rows) + [""] + flops_lines(timed)
    if any(r["kind"] == "memory" for r in rows):
        mem = next(r for r in rows if r["kind"] == "memory")
        lines += [
            f"Memory per rank at {mem['block']} tokens, `disttrain plan` (its +AC row) against one "
            "profiled hand-written step (MB). Measured: parameters, gradients and optimizer state "
            "as the bytes of their storages on the rank (local shards) at the end of backward; "
            "activations + buffers as how far the curve of CPU allocations that torch's profiler "
            "records (profile_memory) rose above its level at the end of backward, over forward + "
            "backward; total = state + that rise (activations, all-gather buffers and every "
            "temporary). The optimizer-step peak (clip, AdamW's temporaries, zero_grad) is not in "
            "the plan; peak RSS is the whole process (libraries too).",
            "",
        ]
        lines += memory_lines(rows) + ["", tied_note(mem), ""]
    if product:
        ckpt = max(r["ckpt_bytes"] for r in product)
        rss = max(r["peak_mb"] for r in product)
        lines += [
            f"disttrain train's checkpoint: {ckpt / 1e9:.2f} GB (weights + AdamW moments, fp32); "
            f"its peak RSS per rank up to {rss:.0f} MB.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--block", type=int, default=256, help="tokens per sequence (GPT-2: 1024)")
    ap.add_argument("--pairs", type=int, default=2, help="product + hand launches per cell")
    ap.add_argument("--first-pair", type=int, default=0, help="number the pairs from here (a later --raw append)")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--compile", default="off", help="off, on, or off,on")
    ap.add_argument("--memory", action="store_true", help="a profiled hand-written launch per strategy")
    ap.add_argument("--shape", default="", help="model overrides for a smoke run: n_layer=2,n_embd=64,n_head=2")
    ap.add_argument("--raw", default="", help="append each launch here (JSON lines); default: a temp file")
    ap.add_argument("--until", default="", help="HH:MM: start no launch that would end after it")
    ap.add_argument("--render-only", action="store_true", help="rewrite the results from --raw")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "gpt2.md"))
    args = ap.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    shown = [
        x
        for i, x in enumerate(given)
        if not x.startswith(("--raw", "--results", "--render-only"))
        and given[i - 1 : i] not in (["--raw"], ["--results"])
    ]
    args.command = ("python bench/gpt2_bench.py " + " ".join(shown)).strip()
    with tempfile.TemporaryDirectory(prefix="gpt2_bench_") as tmp:
        raw = Path(args.raw) if args.raw else Path(tmp) / "runs.jsonl"
        if not args.render_only:
            campaign(args, prepare_tokens(Path(tmp) / "tokens"), Path(tmp), raw)
        rows = [json.loads(x) for x in raw.read_text().splitlines() if x.strip()]
    commands = list(dict.fromkeys(r.get("command", args.command) for r in rows))
    Path(args.results).write_text(render(rows, "`, then `".join(commands)))
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
