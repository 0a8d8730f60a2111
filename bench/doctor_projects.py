"""Doctor on real projects (issue 26): public projects split once by a hash of each
project's name into a tuning half and a held-back half, each finding reviewed.

tests/doctor_corpus/projects/OWNER__REPO/ keeps what we wrote about a project: project.json
(repository, commit, licence, round) and review.json (a verdict and a reason per finding,
the misses). The project's files are not in the repository: tests/doctor_corpus/manifest.json
pins them and bench/corpus_fetch.py brings them into the cache, where the doctor reads
them. The recorded figures of each round come from the reviews and the manifest alone
(`reviewed_projects`, `frozen_figures`); the current doctor's need the cache
(`measure_projects`). Used by bench/doctor_corpus.py (the section) and
tests/unit/test_doctor_corpus.py.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.corpus_fetch import Entry, load_manifest
from bench.doctor_causes import (  # noqa: F401  (re-exported with the figures)
    HELD_BACK_CAUSES,
    ROUND3_CAUSES,
    ROUND4_CAUSES,
    ROUND5_CAUSES,
    ROUND6_CAUSES,
    ROUND7_CAUSES,
    ROUND8_CAUSES,
    ROUND9_CAUSES,
    ROUND10_CAUSES,
    ROUND11_CAUSES,
)
from disttrain.doctor.analyzer import analyze_paths

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "doctor_corpus"

PROJECTS = CORPUS / "projects"

# What each rule's findings are about: hygiene (a habit that bites later: no timeout,
# unpickling, a torn checkpoint), behavioural (a hang or a wrong result), or other
# (advice, performance, log noise). Recall is reported for the first two.
HYGIENE = {"init-without-timeout", "load-without-weights-only", "non-atomic-save"}
# checkpoint-missing-state (no RNG state) makes a resume inexact, not wrong: other.
OTHER = {
    "unguarded-log",
    "mp-spawn",
    "data-parallel",
    "hardcoded-master-port",
    "find-unused-parameters",
    "load-without-map-location",
    "ddp-state-dict-prefix",
    "accumulation-without-no-sync",
    "checkpoint-missing-state",
}


def category(rule: str) -> str:
    return "hygiene" if rule in HYGIENE else "other" if rule in OTHER else "behavioural"


def half(name: str) -> str:
    """The split, made once before any tuning: a project is held back when the first byte
    of sha256(lower-cased "owner/repo") is odd."""
    import hashlib

    return "held-back" if hashlib.sha256(name.lower().encode()).digest()[0] % 2 else "tuning"


@dataclass
class ProjectResult:
    name: str
    half: str
    files: int
    lines: int
    found: list  # (file, rule, line, severity)
    verdicts: dict  # (file, rule, line, severity) -> verdict entry, as the review recorded it
    missed: list  # reviewer's entries for real problems no finding reports
    unreviewed: list
    round: int = 1  # 1: in the corpus when the split was made; n > 1: added after round n-1's fixes
    listed_missed: list = field(default_factory=list)  # review.json's own `missed` entries

    def verdict(self, key: tuple) -> dict | None:
        """The review's entry for a finding `(file, rule, line, severity)`."""
        return verdict_for(self.verdicts.values(), key)


def verdict_for(entries, key: tuple) -> dict | None:
    """The entry among review `entries` for a finding `(file, rule, line, severity)`:
    matched on its place and rule, not its severity, so a finding that moved between error
    and warning keeps its verdict; of two entries at one place, the one whose severity
    is the finding's."""
    at = [e for e in entries if (e["file"], e["rule"], e["line"]) == key[:3]]
    return next((e for e in at if e["severity"] == key[3]), at[0] if at else None)


def project_dirs() -> list[Path]:
    """The reviewed projects' folders in the tree (project.json and review.json)."""
    return sorted(p for p in PROJECTS.iterdir() if (p / "project.json").exists()) if PROJECTS.exists() else []


def _project_files(d: Path, manifest: list[Entry]) -> list[Entry]:
    prefix = f"{PROJECTS.name}/{d.name}/"
    return [e for e in manifest if e.file.startswith(prefix)]


def measure_project(d: Path, cache: Path | None = None, manifest: list[Entry] | None = None) -> ProjectResult:
    """Project `d`'s review, with the current doctor's findings on its files in `cache`
    (checked as one program); with no cache, its files and lines from the manifest and
    no findings (enough for the recorded figures, `frozen_figures`)."""
    meta = json.loads((d / "project.json").read_text())
    if cache is None:
        entries = _project_files(d, load_manifest() if manifest is None else manifest)
        nfiles, lines, got = len(entries), sum(e.lines for e in entries), []
    else:
        root = cache / d.relative_to(PROJECTS.parent)
        files, found = analyze_paths([str(root)])
        nfiles, lines = len(files), sum(len(p.read_text().splitlines()) for p in files)
        got = [(Path(f.file).relative_to(root).as_posix(), f.rule, f.line, f.severity) for f in found]
    review_path = d / "review.json"
    review = json.loads(review_path.read_text()) if review_path.exists() else {"findings": [], "missed": []}
    verdicts = {(e["file"], e["rule"], e["line"], e["severity"]): e for e in review.get("findings", [])}
    matched = {g: verdict_for(verdicts.values(), g) for g in got}
    unreviewed = [g for g in got if matched[g] is None]
    given = {id(e) for e in matched.values()}
    missed = list(review.get("missed", []))
    # a true finding no longer given is a miss; a false one no longer given is gone
    for key, e in verdicts.items():
        if id(e) not in given and e["verdict"] == "true":
            missed.append(
                {
                    "file": key[0],
                    "line": key[2],
                    "rule": key[1],
                    "kind": category(key[1]),
                    "reason": "(no longer reported) " + e.get("reason", ""),
                }
            )
    return ProjectResult(
        meta["name"],
        half(meta["name"]),
        nfiles,
        lines,
        got,
        verdicts,
        missed,
        unreviewed,
        meta.get("round", 1),
        list(review.get("missed", [])),
    )


_MEASURED: dict = {}


def measure_projects(cache: Path) -> list[ProjectResult]:
    """Every project, the current doctor run on its files in `cache`; once per process
    (the section asks several times)."""
    key = (
        cache,
        tuple((d, (d / "review.json").stat().st_mtime if (d / "review.json").exists() else 0) for d in project_dirs()),
    )
    if key not in _MEASURED:
        _MEASURED.clear()
        _MEASURED[key] = [measure_project(d, cache) for d in project_dirs()]
    return _MEASURED[key]


def reviewed_projects() -> list[ProjectResult]:
    """Every project as its review and the manifest describe it, no doctor run and no
    corpus needed: what `frozen_figures` counts."""
    manifest = load_manifest()
    return [measure_project(d, None, manifest) for d in project_dirs()]


def project_totals(results: list[ProjectResult]) -> dict:
    """Counts over some projects: findings true/false (and false errors), per category,
    and the misses per category."""
    t: dict = defaultdict(int)
    for r in results:
        t["projects"] += 1
        t["lines"] += r.lines
        t["files"] += r.files
        for key in r.found:
            e = r.verdict(key)
            if e is None:
                continue
            cat = category(key[1])
            if e["verdict"] == "true":
                t["tp"] += 1
                t[f"tp_{cat}"] += 1
            else:
                t["fp"] += 1
                t["fp_error"] += key[3] == "error"
        for m in r.missed:
            t[f"fn_{m.get('kind', category(m.get('rule', '')))}"] += 1
    return dict(t)


def project_figures(t: dict) -> dict:
    def ratio(a, b):
        return a / b if b else None

    return {
        "false_errors": t.get("fp_error", 0),
        "false_per_500": t.get("fp", 0) / t["lines"] * 500 if t.get("lines") else 0.0,
        "precision": ratio(t.get("tp", 0), t.get("tp", 0) + t.get("fp", 0)),
        "hygiene_recall": ratio(t.get("tp_hygiene", 0), t.get("tp_hygiene", 0) + t.get("fn_hygiene", 0)),
        "behavioural_recall": ratio(
            t.get("tp_behavioural", 0), t.get("tp_behavioural", 0) + t.get("fn_behavioural", 0)
        ),
    }


PROJECT_TARGETS = {
    "false_errors": 0,
    "false_per_500": 1.0,
    "precision": 0.85,
    "hygiene_recall": 0.90,
    "behavioural_recall": 0.50,
}


def project_misses(fig: dict) -> list[str]:
    out = []
    if fig["false_errors"] > PROJECT_TARGETS["false_errors"]:
        out.append(f"{fig['false_errors']} false error(s) (target 0)")
    if fig["false_per_500"] > PROJECT_TARGETS["false_per_500"]:
        out.append(f"{fig['false_per_500']:.2f} false findings per 500 lines (target <= 1)")
    for k, label in (
        ("precision", "precision"),
        ("hygiene_recall", "hygiene recall"),
        ("behavioural_recall", "behavioural recall"),
    ):
        if fig[k] is not None and fig[k] < PROJECT_TARGETS[k]:
            out.append(f"{label} {fig[k]:.0%} (target >= {PROJECT_TARGETS[k]:.0%})")
    return out


def rule_table(results: list[ProjectResult]) -> str:
    """Per rule over some projects: true, false (false errors), missed."""
    per: dict = defaultdict(lambda: defaultdict(int))
    for r in results:
        for key in r.found:
            e = r.verdict(key)
            if e is None:
                continue
            s = per[key[1]]
            s["tp" if e["verdict"] == "true" else "fp"] += 1
            s["fp_error"] += e["verdict"] != "true" and key[3] == "error"
        for m in r.missed:
            per[m.get("rule", "?")]["fn"] += 1
    rows = ["| rule | category | true | false (errors) | missed |", "|---|---|---|---|---|"]
    for rule in sorted(per):
        s = per[rule]
        rows.append(f"| {rule} | {category(rule)} | {s['tp']} | {s['fp']} ({s['fp_error']}) | {s['fn']} |")
    return "\n".join(rows)


# Each round's held-back figures, measured with the doctor frozen before that round was
# reviewed: the honest figures of that doctor. The rules were then changed for what the
# review found, so recomputing an earlier round now would not be honest.
# (a round's figures mix counts, ratios and (found, of) pairs: the keys of round_figures)
RECORDED: dict[int, dict[str, Any]] = {
    1: {
        "projects": 31,
        "files": None,
        "lines": 24866,
        "findings": 255,
        "tp": 168,
        "fp": 87,
        "false_errors": 10,
        "false_per_500": 1.75,
        "precision": 0.66,
        "hygiene": (106, 115),
        "behavioural": (9, 12),
    },
    2: {
        "projects": 13,
        "files": 27,
        "lines": 8175,
        "findings": 85,
        "tp": 64,
        "fp": 21,
        "false_errors": 2,
        "false_per_500": 1.28,
        "precision": 0.75,
        "hygiene": (39, 39),
        "behavioural": (11, 12),
    },
    3: {
        "projects": 11,
        "files": 20,
        "lines": 8608,
        "findings": 57,
        "tp": 42,
        "fp": 15,
        "false_errors": 2,
        "false_per_500": 0.87,
        "precision": 0.74,
        "hygiene": (20, 24),
        "behavioural": (2, 12),
    },
    4: {
        "projects": 11,
        "files": 20,
        "lines": 10197,
        "findings": 49,
        "tp": 39,
        "fp": 10,
        "false_errors": 1,
        "false_per_500": 0.49,
        "precision": 0.8,
        "hygiene": (16, 17),
        "behavioural": (3, 7),
    },
    5: {
        "projects": 8,
        "files": 14,
        "lines": 7955,
        "findings": 43,
        "tp": 33,
        "fp": 10,
        "false_errors": 4,
        "false_per_500": 0.63,
        "precision": 0.77,
        "hygiene": (15, 18),
        "behavioural": (1, 5),
    },
    6: {
        "projects": 9,
        "files": 15,
        "lines": 8792,
        "findings": 87,
        "tp": 48,
        "fp": 39,
        "false_errors": 0,
        "false_per_500": 2.22,
        "precision": 0.55,
        "hygiene": (20, 27),
        "behavioural": (6, 9),
    },
    7: {
        "projects": 9,
        "files": 19,
        "lines": 9091,
        "findings": 78,
        "tp": 55,
        "fp": 23,
        "false_errors": 4,
        "false_per_500": 1.26,
        "precision": 0.71,
        "hygiene": (25, 29),
        "behavioural": (2, 5),
    },
    8: {
        "projects": 12,
        "files": 28,
        "lines": 8299,
        "findings": 81,
        "tp": 68,
        "fp": 13,
        "false_errors": 0,
        "false_per_500": 0.78,
        "precision": 0.84,
        "hygiene": (34, 36),
        "behavioural": (5, 6),
    },
    9: {
        "projects": 8,
        "files": 23,
        "lines": 8701,
        "findings": 93,
        "tp": 79,
        "fp": 14,
        "false_errors": 2,
        "false_per_500": 0.8,
        "precision": 0.85,
        "hygiene": (50, 51),
        "behavioural": (14, 18),
    },
    10: {
        "projects": 9,
        "files": 23,
        "lines": 8647,
        "findings": 86,
        "tp": 77,
        "fp": 9,
        "false_errors": 0,
        "false_per_500": 0.52,
        "precision": 0.9,
        "hygiene": (39, 39),
        "behavioural": (2, 3),
    },
    # 20 projects, each reviewed by hand and the review committed before the doctor ran
    11: {
        "projects": 20,
        "files": 67,
        "lines": 18676,
        "findings": 181,
        "tp": 156,
        "fp": 25,
        "false_errors": 3,
        "false_per_500": 0.67,
        "precision": 0.86,
        "hygiene": (93, 96),
        "behavioural": (21, 40),
    },
}
ROUND1_HELD_BACK = RECORDED[1]
FRESH_ROUND = 11  # the latest round: held-back projects no rule was changed for


def round_figures(results: list[ProjectResult]) -> dict[str, Any]:
    """Some projects' figures in the shape RECORDED keeps (what gets recorded for a round)."""
    t = project_totals(results)
    fig = project_figures(t)
    hyg = (t.get("tp_hygiene", 0), t.get("tp_hygiene", 0) + t.get("fn_hygiene", 0))
    beh = (t.get("tp_behavioural", 0), t.get("tp_behavioural", 0) + t.get("fn_behavioural", 0))
    return {
        "projects": t.get("projects", 0),
        "files": t.get("files", 0),
        "lines": t.get("lines", 0),
        "findings": t.get("tp", 0) + t.get("fp", 0),
        "tp": t.get("tp", 0),
        "fp": t.get("fp", 0),
        "false_errors": fig["false_errors"],
        "false_per_500": round(fig["false_per_500"], 2),
        "precision": None if fig["precision"] is None else round(fig["precision"], 2),
        "hygiene": hyg,
        "behavioural": beh,
    }


def frozen_figures(results: list[ProjectResult], n: int) -> dict:
    """Round `n`'s held-back figures as the doctor frozen for it gave them, from the
    reviews alone: the findings it gave carry verdicts; a finding a later fix added is
    marked `"after_freeze": n`: a true one was a miss of the frozen doctor (its entry moved
    from `missed` to `findings`; with `"unlisted_then": true` a real problem that review
    did not list, so not in the recorded figures), a false one it never gave. Equal to RECORDED[n] as long
    as the reviews are."""
    rs = held_back_round(results, n)
    t: dict = defaultdict(int)
    for r in rs:
        t["projects"] += 1
        t["files"] += r.files
        t["lines"] += r.lines
        for key, e in r.verdicts.items():
            cat = category(key[1])
            if e.get("after_freeze") == n:
                # a false one the frozen doctor never gave; a true one the review did not
                # list as a miss then (`unlisted_then`) was not counted against it either
                t[f"fn_{cat}"] += e["verdict"] == "true" and not e.get("unlisted_then")
            elif e["verdict"] == "true":
                t["tp"] += 1
                t[f"tp_{cat}"] += 1
            else:
                t["fp"] += 1
                t["fp_error"] += key[3] == "error"
        for m in r.listed_missed:
            t[f"fn_{m.get('kind', category(m.get('rule', '')))}"] += 1
    fig = project_figures(dict(t))
    return {
        "projects": t["projects"],
        "files": t["files"],
        "lines": t["lines"],
        "findings": t["tp"] + t["fp"],
        "tp": t["tp"],
        "fp": t["fp"],
        "false_errors": t["fp_error"],
        "false_per_500": round(fig["false_per_500"], 2),
        "precision": None if fig["precision"] is None else round(fig["precision"], 2),
        "hygiene": (t["tp_hygiene"], t["tp_hygiene"] + t["fn_hygiene"]),
        "behavioural": (t["tp_behavioural"], t["tp_behavioural"] + t["fn_behavioural"]),
    }


def recorded_table(n: int) -> str:
    """Round `n`'s recorded held-back figures against the targets."""
    r = RECORDED[n]

    def recall(pair):
        return f"{pair[0] / pair[1]:.0%} ({pair[0]} / {pair[1]})" if pair[1] else "-"

    return "\n".join(
        [
            f"| measure | round {n} held-back (frozen doctor) | target |",
            "|---|---|---|",
            f"| projects, lines | {r['projects']}, {r['lines']} | |",
            f"| false errors | {r['false_errors']} | 0 |",
            f"| false findings per 500 lines | {r['false_per_500']:.2f} | <= 1 |",
            f"| precision | {r['precision']:.0%} ({r['tp']} / {r['findings']}) | >= 85% |",
            f"| hygiene recall (timeout, weights_only, non-atomic save) | {recall(r['hygiene'])} | >= 90% |",
            f"| behavioural recall (hangs, wrong results) | {recall(r['behavioural'])} | >= 50% |",
        ]
    )


def recorded_misses(n: int) -> list[str]:
    """Round `n`'s recorded figures against the targets, one line per target missed."""
    r = RECORDED[n]
    return project_misses(
        {
            "false_errors": r["false_errors"],
            "false_per_500": r["false_per_500"],
            "precision": r["precision"],
            "hygiene_recall": r["hygiene"][0] / r["hygiene"][1] if r["hygiene"][1] else None,
            "behavioural_recall": r["behavioural"][0] / r["behavioural"][1] if r["behavioural"][1] else None,
        }
    )


def held_back_round(results: list[ProjectResult], n: int) -> list[ProjectResult]:
    """The held-back projects added in round `n`."""
    return [r for r in results if r.half == "held-back" and r.round == n]


def fresh_held_back(results: list[ProjectResult]) -> list[ProjectResult]:
    """The held-back projects the current rules were never changed for: the latest round."""
    return held_back_round(results, FRESH_ROUND)


def projects_table(results: list[ProjectResult], which: str, label: str | None = None) -> str:
    rs = [r for r in results if r.half == which]
    which = label or which
    t = project_totals(rs)
    fig = project_figures(t)
    pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    head = (
        f"{t.get('projects', 0)} projects, {t.get('files', 0)} files, {t.get('lines', 0)} lines; "
        f"{t.get('tp', 0) + t.get('fp', 0)} findings, {t.get('tp', 0)} true, {t.get('fp', 0)} false."
    )
    rows = [
        "| measure | " + which + " | target |",
        "|---|---|---|",
        f"| false errors | {fig['false_errors']} | 0 |",
        f"| false findings per 500 lines | {fig['false_per_500']:.2f} | <= 1 |",
        f"| precision | {pct(fig['precision'])} ({t.get('tp', 0)} / {t.get('tp', 0) + t.get('fp', 0)}) | >= 85% |",
        f"| hygiene recall (timeout, weights_only, non-atomic save) | {pct(fig['hygiene_recall'])} "
        f"({t.get('tp_hygiene', 0)} / {t.get('tp_hygiene', 0) + t.get('fn_hygiene', 0)}) | >= 90% |",
        f"| behavioural recall (hangs, wrong results) | {pct(fig['behavioural_recall'])} "
        f"({t.get('tp_behavioural', 0)} / {t.get('tp_behavioural', 0) + t.get('fn_behavioural', 0)}) | >= 50% |",
    ]
    per = [
        "| project | lines | true | false | false errors | missed (hygiene / behavioural) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rs:
        tt = project_totals([r])
        per.append(
            f"| [{r.name}](https://github.com/{r.name}) | {r.lines} | {tt.get('tp', 0)} | "
            f"{tt.get('fp', 0)} | {tt.get('fp_error', 0)} | {tt.get('fn_hygiene', 0)} / "
            f"{tt.get('fn_behavioural', 0)} |"
        )
    return head + "\n\n" + "\n".join(rows) + "\n\n" + "\n".join(per)
