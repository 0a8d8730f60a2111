"""Find the scripts, parse them, run every rule, drop suppressed findings.

Contract: `analyze_paths(paths)` returns `(files, findings)`: the Python files it read
(in a stable order) and their findings sorted by file, line and column. The files are
judged per program (programs.py: one per entry point, with what it imports); a finding
in a module that several programs share is reported once and names each program it
holds in (`Finding.program`). A path that does
not exist, an unreadable file or one that is not valid Python raises `UserError` naming
the file (and line). Scripts are parsed with `ast`, never imported or run.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

# Importing the rule modules fills the registry (each rule registers itself).
from disttrain.doctor import (  # noqa: F401
    rules_behaviour,
    rules_data,
    rules_ddp,
    rules_device,
    rules_fsdp2,
    rules_io,
    rules_job,
    rules_launch,
    rules_loss_division,
    rules_resume,
    rules_step,
    rules_sync,
)
from disttrain.doctor.dead_code import is_dead
from disttrain.doctor.facts import Facts
from disttrain.doctor.findings import ADVICE, ERROR, RULES, WARNING, Finding, ignore_comments, suppressed
from disttrain.doctor.programs import split
from disttrain.doctor.source_text import read_source
from disttrain.errors import UserError

# Directories that hold other people's code or build output, never the user's scripts.
_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "build", "dist", "venv", ".venv"}


def collect_files(paths: list[str]) -> list[Path]:
    """Files named on the command line, plus every *.py under directories (recursively,
    skipping hidden, virtualenv and build folders). A missing path is a UserError."""
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UserError(f"{raw}: no such file or directory (give the training script(s) to check)")
        if p.is_dir():
            found = []
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(
                    d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS and not d.endswith(".egg-info")
                )
                found += [Path(root) / f for f in files if f.endswith(".py")]
            candidates = sorted(found)
        else:
            candidates = [p]
        for f in candidates:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def parse(path: str, source: str) -> Facts:
    """The Facts of one script; a syntax error is a UserError that names the file and line."""
    try:
        return Facts.parse(path, source)
    except SyntaxError as e:
        raise UserError(
            f"{path}:{e.lineno or 0}: not valid Python ({e.msg}); doctor checks scripts that parse"
        ) from None
    except ValueError as e:  # e.g. source with NUL bytes
        raise UserError(f"{path}: cannot be parsed ({e})") from None


def analyze_source(
    path: str,
    source: str,
    select: set[str] | None = None,
    ignore: set[str] | None = None,
    facts: Facts | None = None,
    advice: bool = False,
) -> list[Finding]:
    """Findings for one script's source text. `select`/`ignore` restrict the rule ids;
    `facts` (already parsed, with the other files of the run) saves parsing again.
    Defects only, unless `advice` (then the preferences too, at severity "advice")."""
    facts = facts or parse(path, source)
    ignores = ignore_comments(source)
    out: list[Finding] = []
    for rule_id, rule in RULES.items():
        if (select and rule_id not in select) or (ignore and rule_id in ignore):
            continue
        for f in rule.check(facts):
            if (advice or f.severity != ADVICE) and not suppressed(f, ignores) and not is_dead(facts, f.line):
                out.append(f)
    # One finding per (rule, place): two routes to the same pitfall say it once.
    unique = {(f.rule, f.line, f.column): f for f in out}
    return sorted(unique.values(), key=lambda f: (f.line, f.column, f.rule))


def analyze_paths(
    paths: list[str], select: set[str] | None = None, ignore: set[str] | None = None, advice: bool = False
) -> tuple[list[Path], list[Finding]]:
    unknown = sorted(r for r in (select or set()) | (ignore or set()) if r not in RULES)
    if unknown:
        raise UserError(f"unknown rule id(s): {', '.join(unknown)}; see `disttrain doctor --list-rules`")
    files = collect_files(paths)
    parsed: list[Facts] = []
    for f in files:
        try:
            source = read_source(f)  # PEP 263: a BOM or a coding line, else UTF-8
        except UnicodeDecodeError:
            raise UserError(f"{f}: not UTF-8 text; doctor checks Python source files") from None
        except OSError as e:
            raise UserError(f"{f}: cannot be read ({e.strerror})") from None
        parsed.append(parse(str(f), source))
    findings: list[Finding] = []
    used: set[int] = set()
    for program in split(parsed, [str(p) for p in paths]):
        # a file in a second program is judged afresh: its answers depend on its program
        members = [parsed[i].fresh() if i in used else parsed[i] for i in program.files]
        used.update(program.files)
        label = (program.entry,) if program.entry else ()
        shown = {parsed[i].path for i in program.reported}
        found = _analyze_program(members, {m.path for m in members} & shown, select, ignore, advice)
        findings += [replace(f, program=label) for f in found]
    order = {str(f): n for n, f in enumerate(files)}
    return files, sorted(_merge(findings), key=lambda f: (order.get(f.file, 0), f.line, f.column, f.rule))


def _analyze_program(
    members: list[Facts], shown: set[str], select: set[str] | None, ignore: set[str] | None, advice: bool
) -> list[Finding]:
    """The findings of the program's files in `shown`, each judged with the program's
    other files in view (and no file outside it)."""
    from disttrain.doctor.dataflow import Project

    project = Project(members)  # one data-flow view of the program, shared by its files
    for facts in members:
        # Rules may follow a call into the other files of the program (a train() in utils/).
        facts.others = [o for o in members if o is not facts]
        facts.__dict__["project"] = project
    out: list[Finding] = []
    for facts in members:
        if facts.path in shown:
            out += analyze_source(facts.path, facts.source, select, ignore, facts, advice)
    return out


_WEIGHT = {ERROR: 2, WARNING: 1, ADVICE: 0}


def _merge(findings: list[Finding]) -> list[Finding]:
    """One finding per place and rule: a module judged in several programs is reported
    once, naming every program it holds in (as an error where one program shows it)."""
    held: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.file, f.line, f.column, f.rule)
        old = held.get(key)
        if old is None:
            held[key] = f
            continue
        best = f if _WEIGHT[f.severity] > _WEIGHT[old.severity] else old
        held[key] = replace(best, program=tuple(dict.fromkeys(old.program + f.program)))
    return list(held.values())


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)
