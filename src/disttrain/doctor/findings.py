"""Findings, rule metadata, the rule registry and `# disttrain: ignore[...]` comments.

A rule is a plain function `check(facts) -> Iterable[Finding]` registered with `@rule`.
Its metadata (id, practice IDs, default severity, title, help) feeds the text report and
the SARIF `tool.driver.rules`. The registry is filled when the rule modules are imported
(`disttrain.doctor.analyzer` imports them all).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

ERROR = "error"
WARNING = "warning"
ADVICE = "advice"  # a preference, not a defect: shown only with `disttrain doctor --advice`


@dataclass(frozen=True)
class Finding:
    """One pitfall at one place. `line`/`column` are 1-based (editor convention);
    `end_line` is the last line of the flagged expression, so an ignore comment on any
    of its lines suppresses it. `witness` is the concrete run that fails (for a hang:
    what each rank class issues up to the first point where they part), empty when the
    finding has none: an error always has one. `program` names the entry files of the
    programs it holds in (programs.py); empty for files no entry point reaches."""

    rule: str
    practices: tuple[str, ...]
    severity: str
    file: str
    line: int
    column: int
    message: str
    fix: str
    end_line: int = 0
    witness: str = ""
    program: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["practices"] = list(self.practices)
        d["program"] = list(self.program)
        d["witness"] = self.witness or None
        del d["end_line"]
        return d


@dataclass(frozen=True)
class Rule:
    id: str
    practices: tuple[str, ...]
    severity: str
    title: str
    help: str
    check: Callable[..., Iterable[Finding]]
    unwitnessed: str = ""  # what the doctor cannot see when it shows no failing run


RULES: dict[str, Rule] = {}


def rule(id: str, practices: tuple[str, ...], severity: str, title: str, help: str, unwitnessed: str = ""):
    """Register `check(facts)` under `id`. `help` is the long explanation and fix
    shown in SARIF rule metadata and by `disttrain doctor --list-rules`. `severity` is
    the most a finding of the rule can be: an error needs a witness (`finding`), and
    `unwitnessed` says what the doctor could not see when a finding has none."""

    def deco(fn):
        if id in RULES:
            raise ValueError(f"duplicate doctor rule id {id!r}")
        RULES[id] = Rule(id, practices, severity, title, " ".join(help.split()), fn, " ".join(unwitnessed.split()))
        return fn

    return deco


def finding(
    facts,
    node: ast.AST,
    rule_id: str,
    message: str,
    fix: str,
    severity: str | None = None,
    practices: tuple[str, ...] | None = None,
    witness: str = "",
) -> Finding:
    """A Finding at `node`, with the rule's defaults unless overridden for this case. An
    error without a `witness` (the run that fails) is a warning that says what the
    doctor could not see (the rule's `unwitnessed`)."""
    meta = RULES[rule_id]
    line = getattr(node, "lineno", 1)
    severity = severity or meta.severity
    if severity == ERROR and not witness:
        severity = WARNING
        message += " " + (meta.unwitnessed or "The doctor shows no run where this fails.")
    return Finding(
        rule=rule_id,
        practices=practices or meta.practices,
        severity=severity,
        file=facts.path,
        line=line,
        column=_column(facts.source, line, getattr(node, "col_offset", 0)) + 1,
        message=message,
        fix=fix,
        end_line=getattr(node, "end_lineno", None) or line,
        witness=witness,
    )


def path_witness(facts, steps: Sequence[tuple[str, ast.AST]], outcome: str) -> str:
    """A witness that is a path: each step at its place, in order, then what goes wrong
    (`fully_shard at train.py:12, then model.no_sync() at train.py:30 -> AttributeError`)."""
    at = [f"{what} at {facts.path}:{getattr(node, 'lineno', 1)}" for what, node in steps]
    return ", then ".join(at) + f" -> {outcome}"


def _column(source: str, line: int, byte_offset: int) -> int:
    """ast gives UTF-8 byte offsets; editors and SARIF count characters."""
    if source.isascii():
        return byte_offset
    lines = source.splitlines()
    if not 0 < line <= len(lines):
        return byte_offset
    return len(lines[line - 1].encode("utf-8")[:byte_offset].decode("utf-8", "replace"))


_IGNORE = re.compile(r"#\s*disttrain:\s*ignore(?:\[([^\]]*)\])?", re.IGNORECASE)
ALL = "*"


def ignore_comments(source: str) -> dict[int, set[str]]:
    """Line -> rule ids suppressed there. `# disttrain: ignore[a, b]` names rules;
    a bare `# disttrain: ignore` suppresses every rule on that line. Only real comments
    count (tokenize), so the text inside a string literal suppresses nothing."""
    out: dict[int, set[str]] = {}
    if "disttrain" not in source.lower():
        return out  # the common case: no comment to find, skip tokenizing
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = _IGNORE.search(tok.string)
        if not m:
            continue
        ids = {ALL} if m.group(1) is None else {x.strip() for x in m.group(1).split(",") if x.strip()}
        out.setdefault(tok.start[0], set()).update(ids)
    return out


def suppressed(f: Finding, ignores: dict[int, set[str]]) -> bool:
    for line in range(f.line, max(f.line, f.end_line) + 1):
        ids = ignores.get(line, ())
        if f.rule in ids or ALL in ids:
            return True
    return False
