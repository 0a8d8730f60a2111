"""The torch releases we claim are the ones we ran: the README's "Supported torch
releases" names the floor that pyproject.toml declares, as the oldest release its table
records, and CI's pinned release lies in the declared range. Reads text only (issue 24)."""

from __future__ import annotations

import re

from conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

RELEASE = re.compile(r"\b2\.\d+(?:\.\d+)?\b")


def _floor() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    m = re.fullmatch(r"torch>=(\d+\.\d+(?:\.\d+)?)", torch.replace(" ", ""))
    assert m, f"pyproject's torch requirement {torch!r} is not a plain floor"
    return m.group(1)


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Supported torch releases\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "README has no section '## Supported torch releases'"
    return m.group(1)


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def test_readme_names_the_floor_pyproject_declares_as_its_oldest_recorded_release():
    floor, section = _floor(), _section()
    rows = [line for line in section.splitlines() if line.startswith("| ") and RELEASE.search(line)]
    assert rows, "the section has no table row naming a release"
    recorded = [RELEASE.search(row.split("|")[1]).group(0) for row in rows]
    oldest = min(recorded, key=_key)
    assert _key(oldest)[:len(_key(floor))] == _key(floor), (
        f"pyproject declares torch>={floor}, the README's oldest recorded release is {oldest}")
    assert f"torch>={floor}" in section, "the section names the declared floor"


def test_ci_pin_lies_in_the_declared_range():
    (pin,) = re.findall(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert _key(pin.split("+")[0]) >= _key(_floor())
