"""Real reported bugs, rebuilt: tests/doctor_corpus/bugs/, one small script per bug
reported in the issue trackers of PyTorch, torchtitan, Accelerate, transformers and
Lightning, each checked alone. A case's header names the issue (`# issue: URL`), what
went wrong (`# summary:`) and its family (`# family:`); `# expect: RULE` on a line is a
finding the doctor must give there. Recall per family = expected findings given /
expected findings. Our own scripts: no corpus to fetch, so the test suite runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from disttrain.doctor.analyzer import analyze_paths

BUGS = Path(__file__).resolve().parent.parent / "tests" / "doctor_corpus" / "bugs"

_HEADER = re.compile(r"^#\s*(issue|summary|family):\s*(.+?)\s*$")
_EXPECT = re.compile(r"#\s*expect:\s*([\w\-, ]+)")


@dataclass
class BugCase:
    path: Path
    issue: str
    summary: str
    family: str
    expected: set = field(default_factory=set)  # (rule, line)
    found: set = field(default_factory=set)  # (rule, line) of every finding


def load_case(path: Path) -> BugCase:
    """Parse a case's header and `# expect:` marks; a case without them is an error."""
    head, expected = {}, set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = _HEADER.match(line)
        if m and m.group(1) not in head:
            head[m.group(1)] = m.group(2)
        e = _EXPECT.search(line)
        if e:
            expected |= {(r.strip(), i) for r in e.group(1).split(",") if r.strip()}
    missing = {"issue", "summary", "family"} - set(head)
    if missing or not expected:
        raise ValueError(
            f"{path}: a bug case needs # issue:, # summary:, # family: and at least "
            f"one `# expect: RULE` (missing: {', '.join(sorted(missing)) or 'expect'})"
        )
    return BugCase(path, head["issue"], head["summary"], head["family"], expected)


def measure_bugs() -> list[BugCase]:
    cases = [load_case(p) for p in sorted(BUGS.glob("*.py"))]
    for case in cases:
        _, found = analyze_paths([str(case.path)])
        case.found = {(f.rule, f.line) for f in found}
    return cases


def family_recall(cases: list[BugCase]) -> dict[str, tuple[int, int, list[BugCase]]]:
    """family -> (expected findings given, expected findings, its cases)."""
    out: dict = {}
    for c in cases:
        hit, total, members = out.get(c.family, (0, 0, []))
        out[c.family] = (hit + len(c.expected & c.found), total + len(c.expected), members + [c])
    return out


def _pct(num: int, den: int) -> str:
    return f"{num / den:.0%}" if den else "-"


def bugs_table(cases: list[BugCase]) -> str:
    fams = family_recall(cases)
    hit = sum(h for h, _, _ in fams.values())
    total = sum(t for _, t, _ in fams.values())
    rows = [
        f"{len(cases)} cases from {len({c.issue for c in cases})} reported issues; "
        f"{hit} of {total} expected findings given (recall {_pct(hit, total)}).",
        "",
        "| family | cases | found / expected | recall | rules |",
        "|---|---|---|---|---|",
    ]
    for fam in sorted(fams):
        h, t, members = fams[fam]
        rules = sorted({r for c in members for r, _ in c.expected})
        rows.append(f"| {fam} | {len(members)} | {h} / {t} | {_pct(h, t)} | {', '.join(rules)} |")
    rows += ["", "| case | issue | what went wrong | found |", "|---|---|---|---|"]
    for c in cases:
        got = len(c.expected & c.found)
        rows.append(f"| `{c.path.name}` | {_issue_link(c.issue)} | {c.summary} | {got} / {len(c.expected)} |")
    return "\n".join(rows)


def _issue_link(url: str) -> str:
    m = re.match(r"https://github\.com/([^/]+/[^/]+)/(?:issues|pull)/(\d+)", url)
    return f"[{m.group(1)}#{m.group(2)}]({url})" if m else url
