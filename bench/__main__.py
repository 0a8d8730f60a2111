"""`python -m bench`: run the benchmark suite on this machine and rewrite BENCHMARKS.md.

    python -m bench                     # everything, about 10 minutes on a quiet 2-core machine
    python -m bench --quick             # smoke run: few steps and repeats (preliminary tables)
    python -m bench --sections imports,memory
    python -m bench --others            # also run bench/*_bench.py written by other benchmarks
    python -m bench --report-only       # re-render BENCHMARKS.md from bench/results/

The timing sections (overhead, product, peers, scaling) share one interleaved job matrix
(bench/matrix.py), so their side-by-side ratios come from the same repeats.
Exit status 0 even when a target is missed: targets are reported, not asserted;
1 when a section could not run at all.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import guard_overhead, imports, memory, overhead, peers, report, scaling
from bench.common import BENCH, ROOT, Options, base_env, command_line, save
from bench.matrix import Matrix

SECTIONS = [overhead, guard_overhead, peers, scaling, memory, imports]
# Benchmarks with their own scripts: script -> (ranks under torchrun, 0 = plain python; arguments;
# extra arguments for --quick). Each writes its own bench/results/*.md, merged by report.
OTHERS = {
    "checkpoint_bench.py": (
        0,
        ["--dir", "{tmp}", "--results", "{results}/checkpoint.md"],
        ["--repeat", "1", "--settle", "0"],
    ),
    "recovery_bench.py": (0, [], []),
    "node_loss_bench.py": (0, [], ["--kills", "1"]),
    "spare_node_bench.py": (0, [], ["--kills", "1"]),
    "grow_bench.py": (0, [], ["--joins", "1"]),
    "spare_rehearsal_bench.py": (0, [], ["--rounds", "1"]),
    "doctor_corpus.py": (0, ["--out", "{results}/doctor.md"], []),
    "check_bench.py": (0, ["--results", "{results}/check.md"], ["--repeats", "1", "--window", "5"]),
    "tp_bench.py": (0, ["--results", "{results}/tp.md"], ["--rounds", "2", "--steps", "3"]),
}


def parse(argv: list[str]) -> tuple[argparse.Namespace, Options]:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps and repeats: a smoke run")
    ap.add_argument(
        "--sections",
        default=",".join(m.NAME for m in SECTIONS),
        help="comma-separated subset of: " + ", ".join(m.NAME for m in SECTIONS),
    )
    ap.add_argument("--only", default="", help="timing jobs to run, e.g. torch_ddp,disttrain_ddp")
    ap.add_argument("--repeats", type=int, help="launches per job (default 5, quick 3)")
    ap.add_argument("--steps", type=int, help="timed optimizer steps per launch (default 20, quick 4)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiles of missed targets")
    ap.add_argument("--others", action="store_true", help="also run the other benchmarks present: " + ", ".join(OTHERS))
    ap.add_argument("--report-only", action="store_true", help="only re-render BENCHMARKS.md")
    ap.add_argument(
        "--output", type=Path, help="folder for BENCHMARKS.md and bench/results (default: the repository root)"
    )
    args = ap.parse_args(argv)
    opts = Options(quick=args.quick, command=command_line(argv), profile=not args.no_profile)
    opts.repeats = args.repeats or (3 if args.quick else 5)
    opts.steps = args.steps or (4 if args.quick else 20)
    opts.warmup = 1 if args.quick else 3
    if args.output:
        opts.out_dir = args.output.resolve()
    unknown = set(args.sections.split(",")) - {m.NAME for m in SECTIONS}
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(m.NAME for m in SECTIONS)}")
    return args, opts


def save_plot(module, data: dict, opts: Options) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = module.plot(data, plt)
    if fig is not None:
        fig.savefig(opts.results / f"{module.NAME}.png", dpi=110)
        plt.close(fig)


def run_others(opts: Options) -> None:
    """Run each other benchmark that exists; they write their own bench/results/*.md."""
    env = base_env(threads=max(1, (os.cpu_count() or 2) // 2))
    env.update({"BENCH_QUICK": "1" if opts.quick else "0", "BENCH_RESULTS": str(opts.results)})
    for name, (ranks, args, quick_args) in OTHERS.items():
        path = BENCH / name
        if not path.exists():
            print(f"[others] {name}: not present, skipped")
            continue
        with tempfile.TemporaryDirectory(prefix="bench-others-") as tmp:
            args = [a.format(tmp=tmp, results=opts.results) for a in args]
            args += quick_args if opts.quick else []
            launcher = (
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks
                else [sys.executable]
            )
            print(f"[others] {name} {' '.join(args)}")
            r = subprocess.run([*launcher, str(path), *args], env=env, cwd=ROOT)
        if r.returncode:
            print(f"[others] {name} exited {r.returncode}")


def main(argv: list[str] | None = None) -> int:
    args, opts = parse(sys.argv[1:] if argv is None else argv)
    chosen = [m for m in SECTIONS if m.NAME in args.sections.split(",")]
    opts.results.mkdir(parents=True, exist_ok=True)
    failed = False
    if not args.report_only:
        start = time.monotonic()
        matrix = Matrix(opts)
        wanted = [job for m in chosen for job in m.jobs()]
        if args.only:
            keep = set(args.only.split(","))
            wanted = [j for j in wanted if j[0] in keep]
        if wanted:
            print(f"[matrix] {len(dict.fromkeys(wanted))} jobs x {opts.repeats} repeats, {opts.steps} timed steps each")
            matrix.run(wanted)
        for module in chosen:
            print(f"[{module.NAME}]")
            try:
                data = module.analyse(matrix, opts)
            except Exception as e:  # one broken section must not lose the others' results
                print(f"[{module.NAME}] failed: {type(e).__name__}: {e}")
                failed = True
                continue
            save(opts, module.NAME, data)
            save_plot(module, load_saved(opts, module.NAME), opts)
        if args.others:
            run_others(opts)
        print(f"[done] {time.monotonic() - start:.0f} s")
    path = report.write(opts, SECTIONS)
    print(f"wrote {path}")
    return 1 if failed else 0


def load_saved(opts: Options, name: str) -> dict:
    """The section's results as `save` wrote them (FileNotFoundError when it did not)."""
    from bench.common import load

    data = load(opts.results, name)
    if data is None:
        raise FileNotFoundError(f"{opts.results / name}.json: no saved results")
    return data


if __name__ == "__main__":
    sys.exit(main())
