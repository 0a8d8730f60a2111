"""mkdocs hook: the generated parts of the documentation site (mkdocs.yml, `hooks:`).

docs/reference/api.md holds the marker `<!-- disttrain:api -->`: it becomes one
mkdocstrings entry, headed `dt.NAME`, per name in `disttrain.__all__`, grouped by the
package that defines it, so a new public name is in the reference without editing the
page. docs/reference/cli.md holds `<!-- disttrain:cli -->`: it becomes each command's own
`--help`, run at build time, so the page cannot drift from the parsers. A page of docs/
that the nav of mkdocs.yml does not name joins its last section ("Guides"), titled by its
first heading, so a new guide is in the site without editing mkdocs.yml. Nothing here
touches the network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
API_MARKER = "<!-- disttrain:api -->"
CLI_MARKER = "<!-- disttrain:cli -->"

# Section titles of the API page, in this order; a package not named here gets its own
# section after these, titled by its name.
SECTIONS = {
    "train": "Training loop and jobs",
    "config": "Configuration",
    "parallel": "Strategies and precision",
    "data": "Data",
    "checkpoint": "Checkpoints",
    "runtime": "Process group and ranks",
    "guard": "Guardrails",
    "errors": "Errors",
}

# Members that the package's own modules read, so they cannot be private (no module reads
# another's private name), but that are no API: left off the page by mkdocstrings' filters.
INTERNAL_MEMBERS = {
    "Job": ("name", "config", "step_in_flight"),
}


def _disttrain():
    # The tree being built, not whichever disttrain happens to be installed.
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    import disttrain
    return disttrain


def public_names() -> dict[str, list[str]]:
    """{package: [public names it defines]} for every name in `disttrain.__all__`."""
    dt = _disttrain()
    groups: dict[str, list[str]] = {}
    for name in dt.__all__:
        module = getattr(dt, name).__module__
        package = module.split(".")[1] if "." in module else "disttrain"
        groups.setdefault(package, []).append(name)
    order = list(SECTIONS) + sorted(set(groups) - set(SECTIONS))
    return {package: groups[package] for package in order if package in groups}


def reference_path(name: str) -> str:
    """Where `dt.NAME` is defined (`disttrain.train.job.Job`): the path of its entry.

    The static reader behind mkdocstrings cannot follow the package's lazy re-exports,
    so each entry documents the definition and is headed with the public name.
    """
    value = getattr(_disttrain(), name)
    return f"{value.__module__}.{value.__qualname__}"


def _entry(name: str) -> str:
    entry = (f"::: {reference_path(name)}\n    options:\n      heading: dt.{name}\n"
             f"      toc_label: dt.{name}\n")
    if name in INTERNAL_MEMBERS:  # mkdocs.yml's filter, and one per internal member
        entry += f"      filters: {['!^_', *(f'!^{m}$' for m in INTERNAL_MEMBERS[name])]}\n"
    return entry


def api_markdown() -> str:
    parts = []
    for package, names in public_names().items():
        parts.append(f"## {SECTIONS.get(package, package)}\n")
        parts += [_entry(name) for name in names]
    return "\n".join(parts)


def commands() -> list[tuple[str, str]]:
    """(command, one-line summary) for each command of `disttrain --help`."""
    _disttrain()
    from disttrain import cli
    listing = cli.USAGE.split("commands:", 1)[1]
    return re.findall(r"^  (\S+)\s+(.+)$", listing, flags=re.MULTILINE)


def _help(argv: list[str]) -> tuple[int, str]:
    env = dict(os.environ, COLUMNS="88", PYTHONPATH=os.pathsep.join(
        [str(SRC)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-m", "disttrain.cli", *argv, "--help"],
                          capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip()


def _subcommands(command: str, summary: str) -> list[str]:
    # A summary such as "disttrain data prepare TEXT_FILES..." names a subcommand.
    return re.findall(rf"disttrain {re.escape(command)} ([a-z][a-z-]*)\b", summary)


def cli_markdown() -> str:
    listed = commands()
    calls = [[]] + [[name] for name, _ in listed]
    calls += [[name, sub] for name, summary in listed for sub in _subcommands(name, summary)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(map(tuple, calls), pool.map(_help, calls), strict=True))
    parts = [f"```text\n{helps[()][1]}\n```\n"]
    for name, summary in listed:
        rc, text = helps[(name,)]
        parts.append(f"## disttrain {name}\n\n{summary}\n")
        if rc != 0:
            parts.append(f"`disttrain {name} --help` answers with its usage only:\n")
        parts.append(f"```text\n{text}\n```\n")
        for sub in _subcommands(name, summary):
            sub_rc, sub_text = helps[(name, sub)]
            if sub_rc == 0 and sub_text != text:
                parts.append(f"### disttrain {name} {sub}\n\n```text\n{sub_text}\n```\n")
    return "\n".join(parts)


def _named(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    items = nav.values() if isinstance(nav, dict) else nav
    return set().union(*map(_named, items)) if items else set()


def on_config(config):
    docs = Path(config["docs_dir"])
    named = _named(config["nav"] or [])
    for page in sorted(docs.rglob("*.md")):
        src = page.relative_to(docs).as_posix()
        if src not in named:
            title = next((line[2:].strip() for line in page.read_text(encoding="utf-8").splitlines()
                          if line.startswith("# ")), page.stem)
            section = next(iter(config["nav"][-1].values()))
            section.append({title: src})
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_markdown())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    return markdown
