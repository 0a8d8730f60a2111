"""Section 7: what `import disttrain` adds to `import torch` (and the peers' imports),
and launch -> first step of the main job against a hand-written DDP loop.

Each sample is a fresh interpreter that imports torch, then the module, timing
both with `time.perf_counter`; the number reported is the second interval, so
torch's own import is not counted. Modules are interleaved within a repeat and one
unrecorded warm-up round fills the file-system cache and the `.pyc` files first.

Launch -> first step: `torchrun -m disttrain.train examples/tiny_gpt.toml` with the
product A/B's settings (bench/workloads/train_spec.py) and `log_every = 1`, against
the same setup written by hand (`FIRST_STEP_HAND`: process group, corpus, DDP, AdamW,
sampler, the evaluation at the start, one step), both under torchrun on 2 ranks,
interleaved. The clock runs from just before torchrun starts to the moment rank 0's
first step is known: the trainer's first metrics line (polled every 5 ms), the hand
loop's time stamp file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import BENCH, Options, base_env, fmt, run_python, summary
from bench.profiles import import_profile

NAME = "imports"
TITLE = "7. `import disttrain` above `import torch`"
TARGET_S = 0.15
TRAINER_TARGET_S = 0.3  # `import disttrain.train.trainer`, what each rank of `disttrain train` imports
FIRST_STEP_TARGET = 1.05  # launch -> first step, main job / hand-written DDP loop
# name -> (package, statement). `import disttrain` is lazy (names load on first use),
# so the second row also touches every name the benchmark's training script uses:
# that is what a script pays before its first step.
MODULES = {
    "disttrain": ("disttrain", "import disttrain"),
    "disttrain, names a script uses": (
        "disttrain",
        "import disttrain as dt; (dt.distributed, dt.wrap, dt.make_optimizer, "
        "dt.Accumulator, dt.DistributedSampler, dt.print_main, dt.global_mean)",
    ),
    "disttrain.train.trainer": ("disttrain", "import disttrain.train.trainer"),
    "accelerate": ("accelerate", "from accelerate import Accelerator"),
    "lightning.fabric": ("lightning", "from lightning.fabric import Fabric"),
}

_PROBE = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "{stmt}; t2 = time.perf_counter(); import json; "
    "print(json.dumps([t1 - t0, t2 - t1]))"
)


def _available(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def measure_imports(wanted: dict[str, tuple[str, str]], opts: Options, log=print) -> dict[str, dict]:
    """{name: summary of seconds above torch} plus 'torch': summary of torch's import.

    `wanted` maps a name to (package, statement). Repeats: `opts.repeats`, at least
    7 (3 when quick). A package that is not installed or fails to import is left out.
    """
    modules = [m for m in wanted if _available(wanted[m][0])]
    samples: dict[str, list[float]] = {m: [] for m in modules}
    torch_s: list[float] = []
    repeats = max(opts.repeats, 3 if opts.quick else 7)
    for repeat in range(repeats + 1):  # round 0 is the warm-up
        for module in modules:
            r = run_python(_PROBE.format(stmt=wanted[module][1]))
            if r.returncode != 0:
                log(f"  import {module} failed: {r.stderr.strip().splitlines()[-1:]}")
                samples.pop(module, None)
                modules = [m for m in modules if m != module]
                continue
            t_torch, t_mod = json.loads(r.stdout.strip().splitlines()[-1])
            if repeat:
                samples[module].append(t_mod)
                torch_s.append(t_torch)
    out = {m: summary(v) for m, v in samples.items()}
    out["torch"] = summary(torch_s)
    return out


FIRST_STEP_HAND = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
sys.path.insert(0, os.environ["BENCH_WORKLOADS"])
from train_spec import config
from disttrain.builtin.corpus import ChunkDataset, load_stdlib_corpus
from disttrain.builtin.gpt import GPT, GPTConfig
cfg = config()
m, d, o, t = cfg["model"], cfg["data"], cfg["optim"], cfg["train"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(t.get("seed", 1337))
corpus = load_stdlib_corpus(d["max_bytes"], d["heldout_fraction"])
train_set, heldout = ChunkDataset(corpus.train, m["block_size"]), ChunkDataset(corpus.heldout, m["block_size"])
model = DDP(GPT(GPTConfig(**m)), gradient_as_bucket_view=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(0.9, 0.95))
sampler = DistributedSampler(train_set, seed=t.get("seed", 1337))
loader = DataLoader(train_set, batch_size=t["batch_size"], sampler=sampler, drop_last=True)
with torch.no_grad():  # hand_train.evaluate: its module imports DCP, which this loop never uses
    model.eval()
    n = min(len(heldout), t["eval_batches"] * t["batch_size"] * world)
    mine = list(range(rank, n, world))
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(mine), t["batch_size"]):
        xs, ys = (torch.stack(v) for v in zip(*(heldout[i] for i in mine[start:start + t["batch_size"]])))
        _, l = model(xs, ys)
        total += torch.tensor([float(l) * ys.numel(), ys.numel()], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
x, y = next(iter(loader))
_, loss = model(x, y)
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
optimizer.step()
loss_sum = torch.tensor([float(loss) * y.numel(), y.numel()], dtype=torch.float64)
dist.all_reduce(loss_sum)
if rank == 0:
    open(os.environ["BENCH_FIRST_STEP"], "w").write(repr(time.time()))
dist.destroy_process_group()
# torch 2.13's gloo group, freed with the DDP model at interpreter exit, aborts or
# deadlocks on the GIL with its worker thread; runtime.shutdown guards disttrain's side.
os._exit(0)
"""


def _first_step_once(kind: str, tmp: Path, timeout: float = 180.0) -> float:
    """Seconds from launch to rank 0's first optimizer step, for 'disttrain' or 'hand'."""
    if str(BENCH / "workloads") not in sys.path:
        sys.path.insert(0, str(BENCH / "workloads"))
    from train_spec import CONFIG, overrides

    env = base_env(threads=1)
    env.update(
        {"BENCH_WORKLOADS": str(BENCH / "workloads"), "BENCH_FIRST_STEP": str(tmp / "t"), "BENCH_TRAIN_STEPS": "1"}
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    if kind == "hand":
        (tmp / "hand.py").write_text(FIRST_STEP_HAND)
        cmd = [*run, str(tmp / "hand.py")]
    else:
        cmd = [
            *run,
            "-m",
            "disttrain.train",
            str(CONFIG),
            *overrides(),
            "--train.log_every=1",
            f"--train.out_dir={tmp / 'run'}",
        ]
    metrics, stamp = tmp / "run" / "metrics.jsonl", tmp / "t"
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while first is None and time.time() - t0 < timeout:
        if kind != "hand" and metrics.exists() and metrics.read_text().strip():
            first = time.time()
        elif proc.poll() is not None and kind != "hand":
            break
        elif kind == "hand" and proc.poll() is not None:
            first = float(stamp.read_text()) if stamp.exists() else None
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode or first is None:
        lines = [ln for ln in err.decode(errors="replace").splitlines() if "rror" in ln or "signal" in ln]
        raise RuntimeError(f"{kind} run exited {proc.returncode}: " + " / ".join(lines[-4:])[-600:])
    return first - t0


def measure_first_step(opts: Options, log=print) -> dict:
    """{'disttrain', 'hand': summary of seconds, 'ratio': summary of paired ratios}."""
    repeats = max(3, opts.repeats if not opts.quick else 2)
    ours, hand, failures = [], [], []
    for repeat in range(repeats + 1):  # round 0 warms the caches, unrecorded
        with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp:
            a_dir, b_dir = Path(tmp, "a"), Path(tmp, "b")
            a_dir.mkdir()
            b_dir.mkdir()
            try:  # a failed launch costs its repeat (reported), not the section
                a = _first_step_once("disttrain", a_dir)
                b = _first_step_once("hand", b_dir)
            except RuntimeError as e:
                failures.append(str(e))
                log(f"  first step: {e}")
                continue
        if repeat:
            ours.append(a)
            hand.append(b)
            log(f"  first step: disttrain {a:.2f} s, hand-written {b:.2f} s")
    if not ours:
        raise RuntimeError("; ".join(failures) or "no repeat")
    return {
        "disttrain": summary(ours),
        "hand": summary(hand),
        "failures": failures,
        "ratio": summary([x / y for x, y in zip(ours, hand, strict=False)]),
        "load": os.getloadavg()[0],
    }


def jobs() -> list[tuple[str, int]]:
    return []


def cached(matrix, opts: Options, log=print) -> dict[str, dict]:
    """`measure_imports(MODULES)` once per suite run, shared by sections 2 and 7."""
    if "imports" not in matrix.extra:
        matrix.extra["imports"] = measure_imports(MODULES, opts, log=log)
    return matrix.extra["imports"]


def analyse(matrix, opts: Options) -> dict:
    res = cached(matrix, opts)
    ours = res.get("disttrain", {})
    missed = bool(ours) and ours["median"] > TARGET_S
    trainer = res.get("disttrain.train.trainer", {})
    try:
        first_step = measure_first_step(opts)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        first_step = {"error": str(e)[-800:]}
    profile = import_profile(MODULES["disttrain"][1]) if (missed and opts.profile) else ""
    # The lazy import moves the cost to first use; show what that first use loads.
    use = res.get("disttrain, names a script uses", {})
    use_profile = (
        import_profile(MODULES["disttrain, names a script uses"][1])
        if use and use["median"] > TARGET_S and opts.profile
        else ""
    )
    return {
        "results": res,
        "target_s": TARGET_S,
        "missed": missed,
        "profile": profile,
        "use_profile": use_profile,
        "first_step": first_step,
        "trainer_missed": bool(trainer) and trainer["median"] > TRAINER_TARGET_S,
    }


def render(data: dict) -> str:
    res = data["results"]
    out = ["| statement (fresh interpreter, after `import torch`) | seconds above torch | runs |", "|---|---|---|"]
    for name, (_, stmt) in MODULES.items():
        s = res.get(name)
        out.append(f"| `{stmt}` | {fmt(s) if s else 'not installed'} | {s.get('n', 0) if s else 0} |")
    out.append(f"| (`import torch` itself) | {fmt(res.get('torch', {}))} | {res.get('torch', {}).get('n', 0)} |")
    ours = res.get("disttrain")
    if ours:
        verdict = "MISSED" if data["missed"] else "met"
        out += [
            "",
            f"Target: `import disttrain` adds at most {data['target_s']} s: **{verdict}** "
            f"(median {ours['median']:.3f} s). `import disttrain` is lazy: the second row is "
            f"the import cost a training script pays by its first step, reported, not targeted.",
        ]
    trainer = res.get("disttrain.train.trainer")
    if trainer:
        verdict = "MISSED" if data.get("trainer_missed") else "met"
        out += [
            "",
            f"Target: `import disttrain.train.trainer` (each rank of `disttrain train`) adds at "
            f"most {TRAINER_TARGET_S} s: **{verdict}** (median {trainer['median']:.3f} s). DCP, "
            f"DTensor (sympy), FSDP, rich, safetensors and transformers load on first use; "
            f"tests/launch/test_imports_startup.py keeps them out.",
        ]
    fs = data.get("first_step")
    if fs and "error" in fs:
        out += ["", f"Launch -> first step: the run failed: `{fs['error'][-300:]}`"]
    elif fs:
        verdict = "met" if fs["ratio"]["median"] <= FIRST_STEP_TARGET else "MISSED"
        out += [
            "",
            "| launch -> first step (torchrun, 2 ranks, tiny_gpt A/B settings) | seconds | runs |",
            "|---|---|---|",
            f"| `disttrain train` (`python -m disttrain.train`) | {fmt(fs['disttrain'])} | {fs['disttrain']['n']} |",
            f"| the same set-up written by hand (DDP) | {fmt(fs['hand'])} | {fs['hand']['n']} |",
            f"| ratio, paired within each repeat | {fmt(fs['ratio'])} | {fs['ratio']['n']} |",
            "",
            f"Target: launch -> first step within {FIRST_STEP_TARGET}x the hand-written loop's: "
            f"**{verdict}** (median ratio {fs['ratio']['median']:.2f}; load average "
            f"{fs['load']:.1f} at the end).",
        ]
        if fs.get("failures"):
            out += [
                "",
                f"{len(fs['failures'])} launch(es) failed and were left out: "
                + "; ".join(f"`{f[:300]}`" for f in fs["failures"]),
            ]
    if data.get("profile"):
        out += [
            "",
            "Why (`-X importtime`, modules loaded after torch, by cumulative time):",
            "",
            "```",
            data["profile"],
            "```",
        ]
    if data.get("use_profile"):
        out += [
            "",
            "What first use of the names loads (`-X importtime`, after torch, by "
            "cumulative time; this is most of disttrain's extra time to first step in "
            "section 1):",
            "",
            "```",
            data["use_profile"],
            "```",
        ]
    return "\n".join(out)


def plot(data: dict, plt):
    res = data["results"]
    names = [m for m in MODULES if res.get(m)]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(6, 2.8))
    med = [res[m]["median"] for m in names]
    err = [
        [m - res[n]["min"] for m, n in zip(med, names, strict=False)],
        [res[n]["max"] - m for m, n in zip(med, names, strict=False)],
    ]
    ax.barh(names, med, xerr=err, color="#4878a8")
    ax.axvline(data["target_s"], color="#c44", ls="--", label=f"target {data['target_s']} s")
    ax.set_xlabel("seconds above import torch (median, min-max)")
    ax.legend()
    fig.tight_layout()
    return fig
