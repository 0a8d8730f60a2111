"""Lines of user code changed to go from the single-device script to each converted one.

Both files are reduced to their code lines first: the module docstring, comments
and blank lines are dropped, and leading and trailing spaces stripped (as
`git diff -w` reads it), so a reworded comment or a body re-indented under a
`with` block does not count, and a moved or edited line does. The count is `difflib`'s: lines only in the
converted script (added) plus lines only in the plain one (removed); a line
edited in place counts once on each side, as a reviewer would read it.

    python -m bench.code_diff PLAIN CONVERTED [--diff]   # any two scripts: the count (and diff)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import tokenize
from pathlib import Path

from bench.common import WORKLOADS

PLAIN = "plain.py"


def code_lines(source: str) -> list[str]:
    """The source's code lines: no module docstring, comments, blank lines or indentation."""
    tree = ast.parse(source)
    skip: set[int] = set()
    body = tree.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comments: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.start[1]
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        if number in skip:
            continue
        if number in comments:
            line = line[: comments[number]]
        line = line.strip()
        if line.strip():
            lines.append(line)
    return lines


def diff_counts(plain: str, converted: str) -> dict:
    """{'added', 'removed', 'changed', 'total'} between two sources (code lines only)."""
    a, b = code_lines(plain), code_lines(converted)
    added = removed = 0
    for line in difflib.ndiff(a, b):
        if line.startswith("+ "):
            added += 1
        elif line.startswith("- "):
            removed += 1
    return {"added": added, "removed": removed, "changed": added + removed, "total": len(b)}


def unified(plain: str, converted: str, name: str) -> str:
    """The code-line diff as a reviewer reads it (for the report's details block)."""
    return "\n".join(difflib.unified_diff(code_lines(plain), code_lines(converted), PLAIN, name, lineterm="", n=0))


def count_all(names: dict[str, str], folder: Path = WORKLOADS) -> dict[str, dict]:
    """`diff_counts` of each script in `names` (key -> file) against plain.py."""
    plain = (folder / PLAIN).read_text()
    out = {}
    for key, file in names.items():
        text = (folder / file).read_text()
        out[key] = {"file": file, **diff_counts(plain, text), "diff": unified(plain, text, file)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.code_diff", description="changed code lines from one script to another"
    )
    ap.add_argument("plain")
    ap.add_argument("converted")
    ap.add_argument("--diff", action="store_true", help="also print the code-line diff")
    a = ap.parse_args(argv)
    plain, converted = Path(a.plain).read_text(), Path(a.converted).read_text()
    c = diff_counts(plain, converted)
    print(
        f"{c['changed']} changed code lines ({c['added']} added, {c['removed']} removed); "
        f"{a.converted} has {c['total']}"
    )
    if a.diff:
        print(unified(plain, converted, a.converted))


if __name__ == "__main__":
    main()
