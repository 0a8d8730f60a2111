"""disttrain's logger: the level is the application's, rank 0 speaks unless asked
otherwise, a rank's own news passes on any rank, a warning is said once."""

from __future__ import annotations

import logging

import pytest

from disttrain.runtime.log import EVERY_RANK, LOGGER, RANK_FILTER, RANKS_ENV


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Rank 0 of no launcher, the default level, no warning seen yet."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(RANKS_ENV, raising=False)
    level = LOGGER.level
    RANK_FILTER.warned.clear()
    yield
    LOGGER.setLevel(level)
    RANK_FILTER.warned.clear()


def test_it_is_the_disttrain_logger_and_prints_to_stderr(capsys):
    assert logging.getLogger("disttrain") is LOGGER
    LOGGER.info("disttrain checkpoint: note: hello")
    captured = capsys.readouterr()
    assert captured.err == "disttrain checkpoint: note: hello\n" and captured.out == ""


def test_the_level_set_by_the_application_is_obeyed(capsys):
    logging.getLogger("disttrain").setLevel(logging.WARNING)
    LOGGER.info("an info line")
    LOGGER.warning("a warning line")
    err = capsys.readouterr().err
    assert "an info line" not in err and "a warning line" in err
    logging.getLogger("disttrain").setLevel(logging.ERROR)
    LOGGER.warning("another warning")
    assert capsys.readouterr().err == ""


def test_only_rank_0_speaks_by_default(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    LOGGER.info("said by every rank")
    LOGGER.warning("disttrain fault: kill at forward, step 3, rank 1", extra=EVERY_RANK)
    assert capsys.readouterr().err == "disttrain fault: kill at forward, step 3, rank 1\n"
    monkeypatch.setenv("RANK", "0")
    LOGGER.info("said by every rank")
    assert capsys.readouterr().err == "said by every rank\n"


def test_every_rank_when_asked_with_its_prefix(capsys, monkeypatch):
    monkeypatch.setenv(RANKS_ENV, "all")
    for rank in ("0", "3"):
        monkeypatch.setenv("RANK", rank)
        LOGGER.info("step %d done", 7)
    assert capsys.readouterr().err == "[rank 0] step 7 done\n[rank 3] step 7 done\n"
    monkeypatch.setenv(RANKS_ENV, "2,3")
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        LOGGER.info("chosen")
    assert capsys.readouterr().err == "chosen\n"


def test_a_warning_is_said_once(capsys):
    for _ in range(3):
        LOGGER.warning("disttrain checkpoint: warning: the same thing")
    LOGGER.warning("disttrain checkpoint: warning: another thing")
    assert capsys.readouterr().err.splitlines() == ["disttrain checkpoint: warning: the same thing",
                                                     "disttrain checkpoint: warning: another thing"]


LOGGED_LAYERS = ("runtime", "parallel", "data", "elastic", "guard", "checkpoint")


def test_the_library_layers_log_instead_of_printing():
    """`print` is for a command's own output (`*_command.py`); the library layers log."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src" / "disttrain"
    found = []
    for layer in LOGGED_LAYERS:
        for path in sorted((src / layer).rglob("*.py")):
            if path.name.endswith("_command.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not found, f"print() in a library layer; use disttrain.runtime.log.LOGGER: {found}"
