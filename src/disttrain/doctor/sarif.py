"""SARIF 2.1.0 output, for CI code scanning (GitHub uploads it with upload-sarif).

Contract: `render_sarif(files, findings)` returns a JSON document valid against the
official SARIF 2.1.0 schema (tests validate it). The run lists every rule with its
help text and practice IDs, even those without results, so code scanning can show
the rule catalogue; each result points at its rule by `ruleId` and `ruleIndex`.
Artifact URIs are relative (POSIX) when the file lies under the working directory,
so code scanning can match them to the repository; absolute `file://` URIs otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.doctor.findings import ERROR, RULES, Finding

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {ERROR: "error", "warning": "warning"}


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
        "properties": {"tags": ["distributed-training", *r.practices],
                       "practices": list(r.practices)},
    }


def render_sarif(files: list[Path], findings: list[Finding]) -> str:
    rules = list(RULES.values())
    index = {r.id: i for i, r in enumerate(rules)}
    results = []
    for f in findings:
        uri, relative = _uri(f.file)
        location = {"artifactLocation": {"uri": uri}, "region": {
            "startLine": f.line, "startColumn": f.column,
            **({"endLine": f.end_line} if f.end_line >= f.line else {})}}
        if relative:
            location["artifactLocation"]["uriBaseId"] = "%SRCROOT%"
        results.append({
            "ruleId": f.rule,
            "ruleIndex": index[f.rule],
            "level": _LEVEL[f.severity],
            "message": {"text": f"{f.message} Fix: {f.fix}"},
            "locations": [{"physicalLocation": location}],
            "properties": {"practices": list(f.practices), "fix": f.fix},
        })
    artifacts = []
    for p in files:
        uri, relative = _uri(str(p))
        loc = {"uri": uri, **({"uriBaseId": "%SRCROOT%"} if relative else {})}
        artifacts.append({"location": loc, "sourceLanguage": "python"})
    doc = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "disttrain-doctor",
                "fullName": "disttrain doctor: distributed-training pitfalls",
                "version": _version(),
                "rules": [_rule_descriptor(r) for r in rules],
            }},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().resolve().as_uri() + "/"}},
            "artifacts": artifacts,
            "results": results,
            "columnKind": "unicodeCodePoints",
        }],
    }
    return json.dumps(doc, indent=2) + "\n"
