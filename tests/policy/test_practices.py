"""Every practice ID cited in the code, the docs and the tests has an entry in
docs/practices.md, the catalogue that defines them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "docs" / "practices.md"
# A citation: `P-DDP-5`, or a list / range of one family, `P-CKPT-1,2,5` or `P-FSDP-2..7,9`.
CITATION = re.compile(r"\bP-([A-Z]+)-(\d+(?:(?:\.\.|,)\d+)*)")
ENTRY = re.compile(r"^- \*\*(P-[A-Z]+-\d+)\*\* ", re.MULTILINE)
SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh"}


def expand(family: str, numbers: str) -> list[str]:
    """`("CKPT", "1..3,5")` -> `["P-CKPT-1", "P-CKPT-2", "P-CKPT-3", "P-CKPT-5"]`."""
    out = []
    for part in numbers.split(","):
        low, _, high = part.partition("..")
        out += [f"P-{family}-{n}" for n in range(int(low), int(high or low) + 1)]
    return out


def cited_ids() -> dict[str, str]:
    """Each cited ID -> the first file (relative to the repository) that cites it."""
    files = [ROOT / "README.md", *sorted((ROOT / "src").rglob("*")),
             *sorted((ROOT / "docs").rglob("*")), *sorted((ROOT / "tests").rglob("*"))]
    cited: dict[str, str] = {}
    for path in files:
        if path.suffix not in SUFFIXES or not path.is_file() or path == CATALOGUE:
            continue
        if any(part.endswith(".egg-info") for part in path.parts) or path == Path(__file__).resolve():
            continue
        for family, numbers in CITATION.findall(path.read_text(encoding="utf-8")):
            for pid in expand(family, numbers):
                cited.setdefault(pid, str(path.relative_to(ROOT)))
    return cited


def catalogue_ids() -> list[str]:
    return ENTRY.findall(CATALOGUE.read_text(encoding="utf-8"))


def test_expand_reads_lists_and_ranges():
    assert expand("DDP", "5") == ["P-DDP-5"]
    assert expand("FSDP", "2..4,9") == ["P-FSDP-2", "P-FSDP-3", "P-FSDP-4", "P-FSDP-9"]


def test_every_cited_id_is_in_the_catalogue():
    cited = cited_ids()
    assert len(cited) > 30, "the scan found almost no citations: is the pattern still right?"
    known = set(catalogue_ids())
    missing = {pid: where for pid, where in cited.items() if pid not in known}
    assert not missing, f"cited but not defined in docs/practices.md: {missing}"


def test_catalogue_defines_each_id_once():
    ids = catalogue_ids()
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_readme_links_the_catalogue():
    assert "docs/practices.md" in (ROOT / "README.md").read_text(encoding="utf-8")
