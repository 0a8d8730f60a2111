"""Section 7: what `import disttrain` adds to `import torch` (and the peers' imports).

Each sample is a fresh interpreter that imports torch, then the module, timing
both with `time.perf_counter`; the number reported is the second interval, so
torch's own import is not counted. Modules are interleaved within a repeat and one
unrecorded warm-up round fills the file-system cache and the `.pyc` files first.
"""

from __future__ import annotations

import json

from bench.common import Options, fmt, run_python, summary
from bench.profiles import import_profile

NAME = "imports"
TITLE = "7. `import disttrain` above `import torch`"
TARGET_S = 0.15
# name -> (package, statement). `import disttrain` is lazy (names load on first use),
# so the second row also touches every name the benchmark's training script uses:
# that is what a script pays before its first step.
MODULES = {
    "disttrain": ("disttrain", "import disttrain"),
    "disttrain, names a script uses": (
        "disttrain", "import disttrain as dt; (dt.distributed, dt.wrap, dt.make_optimizer, "
                     "dt.Accumulator, dt.DistributedSampler, dt.print_main, dt.global_mean)"),
    "accelerate": ("accelerate", "from accelerate import Accelerator"),
    "lightning.fabric": ("lightning", "from lightning.fabric import Fabric"),
}

_PROBE = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
          "{stmt}; t2 = time.perf_counter(); import json; "
          "print(json.dumps([t1 - t0, t2 - t1]))")


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
    profile = import_profile(MODULES["disttrain"][1]) if (missed and opts.profile) else ""
    # The lazy import moves the cost to first use; show what that first use loads.
    use = res.get("disttrain, names a script uses", {})
    use_profile = (import_profile(MODULES["disttrain, names a script uses"][1])
                   if use and use["median"] > TARGET_S and opts.profile else "")
    return {"results": res, "target_s": TARGET_S, "missed": missed, "profile": profile,
            "use_profile": use_profile}


def render(data: dict) -> str:
    res = data["results"]
    out = ["| statement (fresh interpreter, after `import torch`) | seconds above torch | runs |",
           "|---|---|---|"]
    for name, (_, stmt) in MODULES.items():
        s = res.get(name)
        out.append(f"| `{stmt}` | {fmt(s) if s else 'not installed'} | "
                   f"{s.get('n', 0) if s else 0} |")
    out.append(f"| (`import torch` itself) | {fmt(res.get('torch', {}))} | "
               f"{res.get('torch', {}).get('n', 0)} |")
    ours = res.get("disttrain")
    if ours:
        verdict = "MISSED" if data["missed"] else "met"
        out += ["", f"Target: `import disttrain` adds at most {data['target_s']} s: **{verdict}** "
                f"(median {ours['median']:.3f} s). `import disttrain` is lazy: the second row is "
                f"the import cost a training script pays by its first step, reported, not targeted."]
    if data.get("profile"):
        out += ["", "Why (`-X importtime`, modules loaded after torch, by cumulative time):", "",
                "```", data["profile"], "```"]
    if data.get("use_profile"):
        out += ["", "What first use of the names loads (`-X importtime`, after torch, by "
                "cumulative time; this is most of disttrain's extra time to first step in "
                "section 1):", "", "```", data["use_profile"], "```"]
    return "\n".join(out)


def plot(data: dict, plt):
    res = data["results"]
    names = [m for m in MODULES if res.get(m)]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(6, 2.8))
    med = [res[m]["median"] for m in names]
    err = [[m - res[n]["min"] for m, n in zip(med, names)], [res[n]["max"] - m for m, n in zip(med, names)]]
    ax.barh(names, med, xerr=err, color="#4878a8")
    ax.axvline(data["target_s"], color="#c44", ls="--", label=f"target {data['target_s']} s")
    ax.set_xlabel("seconds above import torch (median, min-max)")
    ax.legend()
    fig.tight_layout()
    return fig
