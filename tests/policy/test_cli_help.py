"""The CLI answers as people expect: `--help` on every command exits
0 and lists its options, `disttrain train --help` names every config key of the schema
with its type and default, `disttrain run --help` shows disttrain's own flags and says
that torchrun's pass through, `disttrain --version` prints the version."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from conftest import run_disttrain

from disttrain import cli
from disttrain.cli import COMMANDS
from disttrain.config.key_docs import config_keys
from disttrain.config.schema import Config
from disttrain.version import __version__


def _help(argv: list[str], capsys) -> tuple[int, str, str]:
    """`disttrain ARGV` in this process (a `--help` starts nothing: a subprocess would only
    import torch again; `python -m disttrain.cli` itself is run by the tests below):
    (exit status, stdout, stderr), warnings counted as stderr."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's --help
            code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err + "".join(f"{w.category.__name__}: {w.message}\n" for w in said)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_of_every_command_exits_0_and_lists_its_options(command, capsys):
    code, out, err = _help([command, "--help"], capsys)
    assert code == 0, err
    assert out.startswith("usage: disttrain " + command), out[:200]
    assert "--" in out and err == "", err


def test_version_prints_the_package_version():
    proc = run_disttrain(["--version"], timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"disttrain {__version__}\n"), proc.stderr


def _schema_keys() -> list[tuple[str, dataclasses.Field]]:
    return [(f"{s.name}.{f.name}", f) for s in dataclasses.fields(Config)
            for f in dataclasses.fields(s.default_factory())]


def test_train_help_names_every_key_of_the_schema_with_type_default_and_meaning(capsys):
    lines = _help(["train", "--help"], capsys)[1].splitlines()
    by_key = {line.split()[0]: line for line in lines if line.startswith("  ") and "." in line.split()[0]}
    missing = [key for key, _ in _schema_keys() if key not in by_key]
    assert missing == []
    for key, f in _schema_keys():
        line = by_key[key]
        assert f" {f.type} = " in line, line
        meaning = line.split(" = ", 1)[1].split(None, 1)
        assert len(meaning) == 2 and len(meaning[1]) > 8, f"{key} has no line of meaning: {line!r}"
    assert "steps  int = 1000" in by_key["train.steps"]
    assert '"runs/tiny_gpt"' in by_key["train.out_dir"] and "true" in by_key["checkpoint.enabled"]


def test_a_key_added_to_the_schema_appears_in_the_help(monkeypatch):
    """Generated from the schema: a new field shows without touching the help."""
    from disttrain.config import schema

    @dataclasses.dataclass(kw_only=True)
    class Extended(schema.TrainConfig):
        warp_factor: int = 9
        """How fast the run goes."""

    @dataclasses.dataclass(kw_only=True)
    class WithExtended(schema.Config):
        train: Extended = dataclasses.field(default_factory=Extended)

    monkeypatch.setattr("disttrain.config.key_docs.Config", WithExtended)
    doc = {k.key: k for k in config_keys()}["train.warp_factor"]
    assert (doc.type, doc.default, doc.meaning) == ("int", 9, "How fast the run goes.")


def test_run_help_shows_its_own_flags_and_that_torchrun_flags_pass_through(capsys):
    out = _help(["run", "--help"], capsys)[1]
    for flag in ("--nproc", "--fast-recovery", "--hang-timeout", "--debug"):
        assert f"  {flag}" in out
    assert "Every torchrun flag passes through unchanged" in out
    assert "--rdzv-endpoint" in out and "--max-restarts" in out


def test_help_after_the_script_is_the_scripts_own(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('script got', sys.argv[1:])\n")
    proc = run_disttrain(["run", "--nproc", "1", str(script), "--help"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "script got ['--help']" in proc.stdout and "disttrain flags" not in proc.stdout


def test_bare_disttrain_prints_the_usage_and_exits_2(capsys):
    """No command is a usage error, as in argparse and git: the usage on stderr, exit 2
    (it exited 0, so a script calling `disttrain $CMD` with an empty CMD passed)."""
    from disttrain import cli

    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: disttrain COMMAND" in err and "commands:" in err
    assert cli.main(["--help"]) == 0 and "usage: disttrain COMMAND" in capsys.readouterr().out
