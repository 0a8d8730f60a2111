"""BENCHMARKS.md: one page of headlines, each with its command and goal; the tables in
full and the history stay in bench/results/.

Every section of this suite keeps its numbers in bench/results/NAME.json (with the
command, the machine and the date that produced them), so running one section
rewrites its table and leaves the others as they were last measured. Markdown
files in bench/results/ written by other benchmarks are summarised: their title, the
lines before their first table (the command, the machine), that table and a link to the
file; names starting with `checkpoint` go in section 5, `recovery` or `elastic` in
section 6, `gpu` in the GPU section, `doctor` (bench/doctor_corpus.py) last, any other
one after section 7. A file may mark its headline with `<!-- headline -->` and
`<!-- /headline -->` instead. A `<details>` block of a section (the peers' diffs) goes to
bench/results/NAME_details.md, which is linked, never included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench.common import Options

REGENERATE = "python -m bench"
EXTERNAL = [("5. Checkpoints", ("checkpoint",)), ("6. Recovery", ("recovery", "elastic"))]
LINKED_ONLY = ("product_vote.md", "recovery_fast_fsdp_every4.md")
"""Results kept as history or as a variant of a headline above: linked at the end, not summarised."""


def _machine_line(data: dict) -> str:
    m = data["machine"]
    return (
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']}, Python {m['python']}, "
        f"{m['os']}; {m['date']}; 1-minute load {m['load_1min']} at the start."
    )


def _section(module, data: dict, results: Path) -> list[str]:
    out = [f"## {module.TITLE}", "", f"Command: `{data['command']}`  ", _machine_line(data)]
    if data.get("quick"):
        out.append("**Preliminary** (`--quick`: few steps and repeats; not for conclusions).")
    intro = module.__doc__.strip().split("\n\n")[0].replace("\n", " ").split(": ", 1)[-1]
    out += ["", intro[:1].upper() + intro[1:], "", _details_apart(module.render(data), module.NAME, results)]
    png = results / f"{module.NAME}.png"
    if png.exists():
        out += ["", f"![{module.NAME}](bench/results/{png.name})"]
    return out + [""]


def _external(results: Path, prefixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in results.glob("*.md") if p.name.startswith(prefixes) and not _linked_only(p))


def _linked_only(path: Path) -> bool:
    return path.name in LINKED_ONLY or path.name.endswith("_details.md")


def _demote(text: str, top: int) -> str:
    """Shift the Markdown headings of `text` so that its highest one is at level `top`."""
    levels = [len(m) for m in re.findall(r"^(#+) ", text, flags=re.M)]
    shift = top - min(levels) if levels else 0
    if shift <= 0:
        return text
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m[1]) + shift) + " ", text, flags=re.M)


def _details_apart(text: str, name: str, results: Path) -> str:
    """`text` without its `<details>` blocks, which go to bench/results/NAME_details.md
    (linked under "More in bench/results")."""
    blocks = re.findall(r"<details>.*?</details>", text, flags=re.S)
    if not blocks:
        return text
    (results / f"{name}_details.md").write_text("\n\n".join(blocks) + "\n")
    return re.sub(r"\n*<details>.*?</details>", "", text, flags=re.S)  # linked at the page's end


def headline(text: str) -> str:
    """A results file's headline: between its `<!-- headline -->` marks, else its first
    heading, its first `Command:` line and its first table."""
    marked = re.search(r"<!-- headline -->(.*?)<!-- /headline -->", text, flags=re.S)
    if marked:
        return marked.group(1).strip()
    lines = text.strip().splitlines()
    title = next((line for line in lines if line.startswith("#")), None)
    command = next((line.rstrip() for line in lines if line.startswith("Command:")), None)
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(x for x in (title, "", command, "", *lines[start:end]) if x is not None).strip()


def _summary(path: Path, level: int) -> list[str]:
    """A results file's headline, its highest heading at `level`, and a link to all of it."""
    return [
        _demote(headline(path.read_text()), level),
        "",
        f"All of it: [bench/results/{path.name}](bench/results/{path.name}).",
        "",
    ]


def _include(path: Path, heading: str | None) -> list[str]:
    """A results file's summary under `## heading` (its own headings one level below),
    or at level 2."""
    return [f"## {heading}", "", *_summary(path, 3)] if heading else _summary(path, 2)


def write(opts: Options, modules: list) -> Path:
    """Render BENCHMARKS.md in `opts.out_dir` from every result found; return its path."""
    results = opts.results
    sections = {
        m.NAME: json.loads((results / f"{m.NAME}.json").read_text())
        for m in modules
        if (results / f"{m.NAME}.json").exists()
    }
    quick = any(d.get("quick") for d in sections.values())
    out = [
        "# Benchmarks",
        "",
        "Written by `python -m bench` (bench/__main__.py); do not edit by hand. Each table "
        "names the command and machine that produced it. Timings are the median of the "
        "repeats with (min-max); ratios are taken within the same repeat, side by side. "
        "Targets are reported, never asserted.",
        "",
    ]
    if quick:
        out += [
            "> **Preliminary.** Some tables below come from `--quick` runs on a shared, busy "
            "2-core machine (see each table's load figure): they show the suite works, not "
            "what disttrain costs. Regenerate on a quiet machine with "
            f"`{REGENERATE}` (about 10 minutes; add `--others` to rerun the checkpoint and "
            "recovery benchmarks).",
            "",
        ]
    by_name = {m.NAME: m for m in modules}
    for name, data in sections.items():  # results a section derives for others to cite
        if hasattr(by_name[name], "extra_files"):
            by_name[name].extra_files(data, results)
    used: set[Path] = set()
    for name in ("overhead", "product", "peers", "scaling", "memory"):
        if name in sections:
            out += _section(by_name[name], sections[name], results)
    for heading, prefixes in EXTERNAL:
        found = _external(results, prefixes)
        used.update(found)
        if not found:
            out += [
                f"## {heading}",
                "",
                "Pending: no bench/results/"
                + prefixes[0]
                + "*.md yet (written by bench/"
                + prefixes[0]
                + "_bench.py when it lands).",
                "",
            ]
        for i, path in enumerate(found):  # several files of one section share its heading
            out += _include(path, heading) if i == 0 else _summary(path, 3)
    if "imports" in sections:
        out += _section(by_name["imports"], sections["imports"], results)
    gpu = _external(results, ("gpu",))
    doctor = _external(results, ("doctor",))  # static analysis: after the timings, at the end
    used.update(gpu + doctor)
    for path in sorted(p for p in set(results.glob("*.md")) - used if not _linked_only(p)):
        out += _include(path, None)
    out += ["## GPU (NVIDIA H200)", ""]
    for path in gpu:
        out += _summary(path, 3)
    if not any(p.name == "gpu.md" for p in gpu):
        out += [
            "bench/gpu.sh's comparison (bf16 GPT of about 1B parameters, sequence 2048, at "
            "world 1: disttrain's `fsdp`, which one device runs unsharded under autocast, "
            "against the same unsharded bf16-autocast step written by hand, like for like; "
            "tokens/s, MFU against 989 TFLOP/s, peak memory, async-checkpoint stall) has not "
            "been run since its baseline was made like for like (it was a sharded "
            "`fully_shard` baseline): no GPU was lent for that change. Copy OUTDIR/gpu.md to "
            "bench/results/gpu.md and rerun `python -m bench --report-only` to include it. "
            "A CPU dry run of the same script is a test (tests/launch/test_bench_smoke.py).",
            "",
        ]
    for path in doctor:
        out += _include(path, None)
    more = sorted(p for p in results.glob("*.md") if _linked_only(p))
    if more:
        out += [
            "## More in bench/results",
            "",
            *[f"- [bench/results/{p.name}](bench/results/{p.name})" for p in more],
            "",
        ]
    path = opts.out_dir / "BENCHMARKS.md"
    path.write_text("\n".join(out).rstrip() + "\n")
    return path
