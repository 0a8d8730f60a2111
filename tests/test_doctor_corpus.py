"""`disttrain doctor` on real public training scripts: precision and recall.

tests/doctor_corpus/real/ holds verbatim copies of public scripts (SOURCES.md says where
each comes from). review.json holds a reviewer's verdict on every finding the doctor gives
there when the whole corpus is checked in one run: "true" (a real problem in that script),
"false" (not one), or "missed" (a real problem the doctor does not report; "scope": "out"
when it is beyond what any rule looks for, listed but not counted). A finding with no
verdict fails the test: review it first. Run with -s to see the table (BENCHMARKS.md,
"Doctor on real code", holds the same numbers).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from disttrain.doctor.analyzer import analyze_paths

CORPUS = Path(__file__).parent / "doctor_corpus"
REAL = "real/"


def _measure():
    review = json.loads((CORPUS / "review.json").read_text())
    files, found = analyze_paths([str(CORPUS)])
    real = [p for p in files if p.relative_to(CORPUS).as_posix().startswith(REAL)]
    lines = sum(len(p.read_text().splitlines()) for p in real)
    verdicts = {(path, e["rule"], e["line"], e["severity"]): e for path, entries in review.items() for e in entries}
    got = {(Path(f.file).relative_to(CORPUS).as_posix(), f.rule, f.line, f.severity) for f in found}
    got = {g for g in got if g[0].startswith(REAL)}
    unreviewed = sorted(g for g in got if g not in verdicts)
    stats = defaultdict(lambda: {"tp": 0, "fp": 0, "fn": 0, "fp_error": 0, "out": 0})
    for key, e in verdicts.items():
        s = stats[e["rule"]]
        if e["verdict"] == "missed":
            s["out" if e.get("scope") == "out" else "fn"] += 1
            assert key not in got, f"{key} is reported now: mark it true"
        elif key not in got:  # no longer reported: a true finding missed, a false one gone
            s["fn"] += e["verdict"] == "true"
        elif e["verdict"] == "true":
            s["tp"] += 1
        else:
            s["fp"] += 1
            s["fp_error"] += e["severity"] == "error"
    return len(real), lines, dict(stats), unreviewed


def _table(n_files, lines, stats) -> str:
    rows = ["| rule | true | false | missed | precision | recall |", "|---|---|---|---|---|---|"]
    tot = defaultdict(int)
    for rule in sorted(stats):
        s = stats[rule]
        for k, v in s.items():
            tot[k] += v
        rows.append(_row(rule, s))
    rows.append(_row("**all**", tot))
    fp = tot["fp"]
    head = (f"{n_files} scripts, {lines} lines; {fp} false warnings ({fp / lines * 500:.2f} per 500 "
            f"lines), {tot['fp_error']} false errors; {tot['out']} known miss(es) beyond the rules' scope.")
    return head + "\n\n" + "\n".join(rows)


def _row(name, s) -> str:
    tp, fp, fn = s["tp"], s["fp"], s["fn"]
    prec = f"{tp / (tp + fp):.0%}" if tp + fp else "-"
    rec = f"{tp / (tp + fn):.0%}" if tp + fn else "-"
    missed = f"{fn}" + (f" (+{s['out']} out of scope)" if s["out"] else "")
    return f"| {name} | {tp} | {fp} | {missed} | {prec} | {rec} |"


def test_doctor_on_real_scripts():
    n_files, lines, stats, unreviewed = _measure()
    print("\n" + _table(n_files, lines, stats))
    assert n_files >= 25
    assert unreviewed == [], f"findings with no verdict in review.json: {unreviewed}"
    assert sum(s["fp_error"] for s in stats.values()) == 0, "a false ERROR on a real script"
    assert sum(s["fp"] for s in stats.values()) <= lines / 500, "more than one false warning per 500 lines"
    for rule, s in stats.items():
        if s["tp"] + s["fn"]:
            assert s["tp"] / (s["tp"] + s["fn"]) >= 0.9, f"recall of {rule} under 90%"


# ----- the rule fixes the real scripts called for -----------------------------------

def _rules(source: str) -> list[tuple[str, str]]:
    from disttrain.doctor.analyzer import analyze_source
    return [(f.rule, f.severity) for f in analyze_source("s.py", source)]


def test_init_device_mesh_binds_the_device():  # pytorch/examples tensor_parallel_example.py
    src = ("import os, torch\nfrom torch.distributed.device_mesh import init_device_mesh\n"
           "mesh = init_device_mesh('cuda', (int(os.environ['WORLD_SIZE']),))\n"
           "model = torch.nn.Linear(2, 2).to('cuda')\n")
    assert ("missing-set-device", "error") not in _rules(src)


def test_named_devices_without_a_bind_are_a_warning_and_gloo_needs_none():  # ddp/example.py
    base = ("import os, torch, torch.distributed as dist\nr = int(os.environ['LOCAL_RANK'])\n"
            "dist.init_process_group({b!r}, timeout=t)\nmodel = torch.nn.Linear(2, 2).cuda(r)\n")
    assert ("missing-set-device", "warning") in _rules(base.format(b="nccl"))
    assert not [r for r in _rules(base.format(b="gloo")) if r[0] == "missing-set-device"]
    unnamed = base.format(b="nccl").replace(".cuda(r)", ".cuda()")
    assert ("missing-set-device", "error") in _rules(unnamed)


def test_a_gpu_id_guard_is_a_local_rank_guard():  # ddp-tutorial-series/multigpu.py
    src = ("import os, torch, torch.distributed as dist\ndist.init_process_group('nccl', timeout=t)\n"
           "def save(gpu_id, m):\n    if gpu_id == 0:\n        torch.save(m, 'c.pt.tmp')\n")
    assert ("unguarded-save", "warning") in _rules(src)


def test_a_print_that_names_its_rank_is_meant_per_rank():  # ddp/main.py
    src = ("import os, torch.distributed as dist\nrank = int(os.environ['RANK'])\n"
           "dist.init_process_group('nccl', timeout=t)\nprint(f'running on rank {rank}')\n"
           "print('loading snapshot')\n")
    assert [r for r in _rules(src) if r[0] == "unguarded-log"] == [("unguarded-log", "warning")]


def test_print_in_a_fabric_script_runs_on_every_rank():  # Lightning Fabric examples
    src = ("from lightning.fabric import Fabric\nfabric = Fabric()\nprint('epoch done')\n"
           "if fabric.is_global_zero:\n    print('once')\n")
    assert [r for r in _rules(src) if r[0] == "unguarded-log"] == [("unguarded-log", "warning")]
