"""The documentation site (mkdocs.yml): it builds with `mkdocs build --strict` without the
network, and its reference holds every public name of `disttrain.__all__` (with a
docstring) and every `disttrain` command.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import built_once

import disttrain as dt
from disttrain import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once per test session (`built_once`: each test worker that runs
    one of this module's tests would build it again) with --strict; any proxy points at
    a closed port, so a plugin or theme that fetched something at build time would fail
    the build."""
    if importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[test]" (or ".[docs]")')
    return built_once(tmp_path_factory, "docs-site", _build)


def _build(out: Path) -> Path:
    closed = "http://127.0.0.1:9"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HTTP_PROXY=closed, HTTPS_PROXY=closed,
               http_proxy=closed, https_proxy=closed, ALL_PROXY=closed, NO_PROXY="", no_proxy="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    assert "WARNING" not in log, log[-4000:]
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _auto_docstring(value) -> bool:
    # A dataclass without a docstring is given its signature as __doc__.
    return dataclasses.is_dataclass(value) and (value.__doc__ or "").startswith(value.__name__ + "(")


@pytest.mark.parametrize("name", dt.__all__)
def test_public_name_has_its_own_docstring(name):
    value = getattr(dt, name)
    # __doc__, not inspect.getdoc: a class without one would show its base class's.
    doc = (value.__doc__ or "").strip()
    assert doc and not _auto_docstring(value), f"dt.{name} has no docstring"
    assert len(doc.split()) >= 12, f"dt.{name}'s docstring does not state its contract: {doc!r}"


def test_every_public_name_has_a_reference_entry(site):
    page = (site / "reference" / "api" / "index.html").read_text()
    missing = []
    for name in dt.__all__:
        value = getattr(dt, name)
        anchor = f'id="{value.__module__}.{value.__qualname__}"'
        entry = re.search(re.escape(anchor) + r"[^>]*>\s*(?:<[^>]+>\s*)*dt\." + name + r"\b", page)
        if entry is None:
            missing.append(name)
    assert not missing, f"no reference entry for: {', '.join(missing)}"


def test_reference_shows_arguments_and_defaults(site):
    # one line or one parameter a line, single or double quotes: as a formatter (ruff, black)
    # installed beside mkdocstrings renders it
    text = re.sub(r"\s+", " ", _text(site / "reference" / "api" / "index.html")).replace('"', "'")
    for default in ("progress: bool = True", "precision: str = 'fp32'", "seed: int = 0",
                    "exit_on_preempt: bool = True", "tokens_per_sample: int = 0", "at_start: bool = False"):
        assert default in text, f"the reference does not show {default!r}"


def test_cli_page_has_every_command(site):
    text = _text(site / "reference" / "cli" / "index.html")
    commands = re.findall(r"^  (\S+)\s", cli.USAGE.split("commands:", 1)[1], flags=re.MULTILINE)
    assert len(commands) >= 10
    for command in commands:
        assert re.search(rf"^disttrain {re.escape(command)}¶?$", text, flags=re.MULTILINE), command
        # case-insensitive: a command whose --help fails shows its one-line usage error
        assert f"usage: disttrain {command}" in text.lower(), f"no usage of disttrain {command}"
    # argparse's own option lists, not a copy: the parser's help strings are on the page
    assert "--list-rules" in text and "--tokenizer" in text


def test_every_guide_is_in_the_site_and_its_nav(site):
    home = (site / "index.html").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.stem != "index":
            assert (site / page.stem / "index.html").exists(), page.name
            assert f'href="{page.stem}/" class="md-nav__link"' in home, f"{page.name} is not in the nav"


def test_readme_says_how_to_build_the_reference():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "mkdocs serve" in readme and "mkdocs build --strict" in readme


def test_site_loads_nothing_from_the_web(site):
    # The theme's web fonts are off (mkdocs.yml, font: false): a reader offline sees it all.
    for page in site.rglob("*.html"):
        assert "fonts.googleapis" not in page.read_text(), page


def test_the_reference_hides_the_parts_of_a_job_its_own_package_reads(site):
    """The page showed `finite_check`, with a docstring about the run's parts: the parts
    and the plumbing the train package's modules read (`name`, `config()`,
    `step_in_flight`) are no API, while what a script uses stays."""
    page = (site / "reference" / "api" / "index.html").read_text()
    shown = set(re.findall(r'id="disttrain\.train\.job\.Job\.(\w+)"', page))
    assert not shown & {*dt.Job.__annotations__, "name", "config", "step_in_flight"}, shown
    assert {"wrap", "loader", "evaluator", "resume", "steps", "backward", "log", "step", "cfg"} <= shown
    # hidden from the page, not from the code
    assert all(hasattr(dt.Job, name) for name in ("name", "config", "step_in_flight"))
