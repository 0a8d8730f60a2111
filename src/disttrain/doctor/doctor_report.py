"""The three renderings of the findings: text for people, JSON, and SARIF 2.1.0.

Contracts:
- `print_text` writes a readable report grouped by file (rich styling only when the
  stream is a terminal), ending with a one-line summary.
- `render_json` returns a stable document, `{"version": 1, "files": [...],
  "findings": [...], "summary": {...}}`, with 1-based line/column; each finding has a
  `witness` (the failing run, a string) or null, and a `program`: the entry files of the
  programs it holds in (empty for files no entry point reaches).
- `render_sarif` returns a document valid against the official SARIF 2.1.0 schema
  (tests validate it), for CI code scanning (GitHub's upload-sarif). The run lists every
  rule with its help text and practice IDs, even those without results; each result
  points at its rule by `ruleId` and `ruleIndex`. Artifact URIs are relative (POSIX,
  against %SRCROOT% = the working directory) when the file lies under it, so code
  scanning matches them to the repository; absolute `file://` URIs otherwise.
"""

from __future__ import annotations

import json
import os
import re
from itertools import groupby
from pathlib import Path
from typing import TextIO

from disttrain.doctor.findings import ADVICE, ERROR, RULES, WARNING, Finding

JSON_VERSION = 1


def summary(files: list[Path], findings: list[Finding]) -> dict:
    return {
        "files": len(files),
        "findings": len(findings),
        "errors": sum(f.severity == ERROR for f in findings),
        "warnings": sum(f.severity == WARNING for f in findings),
        "advice": sum(f.severity == ADVICE for f in findings),
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
    cause, the witness, the program (when it is not the file itself) and the fix on their
    own lines, and a one-line summary at the end."""
    # rich is imported here, not at module level: JSON/SARIF runs never pay for it.
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=stream, highlight=False, soft_wrap=True)
    colors = {ERROR: "bold red", WARNING: "yellow", ADVICE: "blue"}
    for path, group in groupby(findings, key=lambda f: f.file):
        console.print(f"[bold underline]{escape(path)}[/]")
        for f in group:
            sev = f"[{colors[f.severity]}]{f.severity:<7}[/]"
            console.print(
                f"  {escape(path)}:{f.line}:{f.column}  {sev} [cyan]{f.rule}[/] [dim]\\[{', '.join(f.practices)}][/]"
            )
            console.print(f"      {escape(f.message)}")
            if f.witness:
                console.print(f"      [magenta]witness:[/] {escape(f.witness)}")
            if f.program and f.program != (f.file,):  # a module of one or more entry scripts
                console.print(f"      [dim]program:[/] {escape(', '.join(f.program))}")
            console.print(f"      [green]fix:[/] {escape(f.fix)}")
        console.print()
    s = summary(files, findings)
    if not findings:
        console.print(f"[green]No findings[/] in {s['files']} file{'s' * (s['files'] != 1)}.")
    else:
        advice = f", {s['advice']} advice" if s["advice"] else ""
        console.print(
            f"{s['errors']} error{'s' * (s['errors'] != 1)}, "
            f"{s['warnings']} warning{'s' * (s['warnings'] != 1)}{advice} "
            f"in {s['files']} file{'s' * (s['files'] != 1)}. "
            + escape("Silence one with `# disttrain: ignore[rule-id]` on its line.")
        )


def print_rules(stream: TextIO) -> None:
    """The rule catalogue: id, severity, practices, title and help."""
    for r in RULES.values():
        stream.write(f"{r.id}  ({r.severity}; {', '.join(r.practices)})\n  {r.title}\n  {r.help}\n\n")


# ----- SARIF 2.1.0 ------------------------------------------------------------------

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {ERROR: "error", WARNING: "warning", ADVICE: "note"}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("disttrain")
    except Exception:  # not installed (running from a source tree)
        return "0.0.0"


def _uri(file: str) -> tuple[str, bool]:
    """(uri, relative?) for a file path as given on the command line."""
    p = Path(file)
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix(), True
    except ValueError:
        return p.resolve().as_uri(), False


def _rule_descriptor(r) -> dict:
    practices = ", ".join(r.practices)
    return {
        "id": r.id,
        "name": "".join(w.capitalize() for w in r.id.split("-")),
        "shortDescription": {"text": r.title},
        "fullDescription": {"text": r.help},
        "help": {
            "text": f"{r.help} (practices: {practices})",
            "markdown": f"**{r.title}** ({practices})\n\n{r.help}\n\n"
            f"Silence one occurrence with `# disttrain: ignore[{r.id}]`.",
        },
        "defaultConfiguration": {"level": _LEVEL[r.severity]},
        "properties": {"tags": ["distributed-training", *r.practices], "practices": list(r.practices)},
    }


def render_sarif(files: list[Path], findings: list[Finding]) -> str:
    rules = list(RULES.values())
    index = {r.id: i for i, r in enumerate(rules)}
    results = []
    for f in findings:
        uri, relative = _uri(f.file)
        artifact = {"uri": uri, **({"uriBaseId": "%SRCROOT%"} if relative else {})}
        location = {
            "artifactLocation": artifact,
            "region": {
                "startLine": f.line,
                "startColumn": f.column,
                **({"endLine": f.end_line} if f.end_line >= f.line else {}),
            },
        }
        results.append(
            {
                "ruleId": f.rule,
                "ruleIndex": index[f.rule],
                "level": _LEVEL[f.severity],
                "message": {"text": f"{f.message}{f' Witness: {f.witness}.' if f.witness else ''} Fix: {f.fix}"},
                "locations": [{"physicalLocation": location}],
                "properties": {
                    "practices": list(f.practices),
                    "fix": f.fix,
                    **({"witness": f.witness} if f.witness else {}),
                    **({"program": list(f.program)} if f.program else {}),
                },
            }
        )
    artifacts = []
    for p in files:
        uri, relative = _uri(str(p))
        loc = {"uri": uri, **({"uriBaseId": "%SRCROOT%"} if relative else {})}
        artifacts.append({"location": loc, "sourceLanguage": "python"})
    doc = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "disttrain-doctor",
                        "fullName": "disttrain doctor: distributed-training pitfalls",
                        "version": _version(),
                        "rules": [_rule_descriptor(r) for r in rules],
                    }
                },
                "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().resolve().as_uri() + "/"}},
                "artifacts": artifacts,
                "results": results,
                "columnKind": "unicodeCodePoints",
            }
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


_TEXT_SUMMARY = re.compile(r"(No findings in \d+ files?\.|\d+ errors?, \d+ warnings?(, \d+ advice)? in \d+ files?\.)")


def is_earlier_report(path: Path) -> bool:
    """Whether `path` holds a report this command wrote (JSON or SARIF naming the tool,
    or text ending in the summary line), which `--output` may replace. Anything else is
    the user's and is never overwritten."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
            f.seek(max(0, os.fstat(f.fileno()).st_size - 400))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    if head.lstrip().startswith("{"):
        return '"disttrain doctor"' in head or '"disttrain-doctor"' in head
    return bool(_TEXT_SUMMARY.search(tail))
