"""Human and JSON renderings of the findings (SARIF lives in `sarif.py`).

Contract: `render_json` returns a stable document, `{"version": 1, "files": [...],
"findings": [...], "summary": {...}}`, with 1-based line/column; `print_text` writes a
readable report grouped by file to a stream (rich styling only when it is a terminal).
"""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path
from typing import TextIO

from disttrain.doctor.findings import ERROR, RULES, WARNING, Finding

JSON_VERSION = 1


def summary(files: list[Path], findings: list[Finding]) -> dict:
    return {
        "files": len(files),
        "findings": len(findings),
        "errors": sum(f.severity == ERROR for f in findings),
        "warnings": sum(f.severity == WARNING for f in findings),
    }


def render_json(files: list[Path], findings: list[Finding]) -> str:
    doc = {
        "version": JSON_VERSION,
        "tool": "disttrain doctor",
        "files": [str(f) for f in files],
        "findings": [f.to_dict() for f in findings],
        "summary": summary(files, findings),
    }
    return json.dumps(doc, indent=2) + "\n"


def print_text(files: list[Path], findings: list[Finding], stream: TextIO) -> None:
    """One block per file; per finding `LINE:COL severity rule-id [practices]`, then the
    cause and the fix on their own lines, and a one-line summary at the end."""
    # rich is imported here, not at module level: JSON/SARIF runs never pay for it.
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=stream, highlight=False, soft_wrap=True)
    colors = {ERROR: "bold red", WARNING: "yellow"}
    for path, group in groupby(findings, key=lambda f: f.file):
        console.print(f"[bold underline]{escape(path)}[/]")
        for f in group:
            sev = f"[{colors[f.severity]}]{f.severity:<7}[/]"
            console.print(f"  {escape(path)}:{f.line}:{f.column}  {sev} [cyan]{f.rule}[/] "
                          f"[dim]\\[{', '.join(f.practices)}][/]")
            console.print(f"      {escape(f.message)}")
            console.print(f"      [green]fix:[/] {escape(f.fix)}")
        console.print()
    s = summary(files, findings)
    if not findings:
        console.print(f"[green]No findings[/] in {s['files']} file{'s' * (s['files'] != 1)}.")
    else:
        console.print(f"{s['errors']} error{'s' * (s['errors'] != 1)}, "
                      f"{s['warnings']} warning{'s' * (s['warnings'] != 1)} "
                      f"in {s['files']} file{'s' * (s['files'] != 1)}. "
                      + escape("Silence one with `# disttrain: ignore[rule-id]` on its line."))


def print_rules(stream: TextIO) -> None:
    """The rule catalogue: id, severity, practices, title and help."""
    for r in RULES.values():
        stream.write(f"{r.id}  ({r.severity}; {', '.join(r.practices)})\n  {r.title}\n  {r.help}\n\n")
