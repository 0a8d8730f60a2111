"""Text from a checkpoint folder never reaches the terminal as an escape sequence
(docs/security.md): `ckpt verify`, `ckpt inspect` and every one-line error print it
escaped (`terminal_text.shown`), so the user sees `\\x1b[31m` and the terminal acts on
nothing."""

import json

import pytest
from conftest import checkpoint_copy

from disttrain.cli import main as cli
from disttrain.terminal_text import shown

pytestmark = pytest.mark.timeout(120)

RED = "\x1b[31m"
CONTROLS = [chr(c) for c in range(32) if c != 10] + ["\x7f", "\x9b", "\u202e", "\u2028"]


def _with_manifest(saved, tmp_path, change):
    _, step_dir = checkpoint_copy(saved, tmp_path)
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return step_dir


def _printed(capsys) -> str:
    out = capsys.readouterr()
    return out.out + out.err


def test_verify_escapes_a_file_name_of_the_manifest(tiny_checkpoint, tmp_path, capsys):
    step_dir = _with_manifest(tiny_checkpoint, tmp_path, lambda m: m["files"].__setitem__(f"{RED}x.json", {"size": 1}))
    assert cli(["ckpt", "verify", str(step_dir)]) == 1  # the listed file is missing
    text = _printed(capsys)
    assert "\x1b" not in text and "\\x1b[31mx.json" in text, text


def test_verify_escapes_a_value_of_the_manifest(tiny_checkpoint, tmp_path, capsys):
    step_dir = _with_manifest(tiny_checkpoint, tmp_path, lambda m: m.__setitem__("step", f"{RED}1\r\x07"))
    assert cli(["ckpt", "verify", str(step_dir)]) == 1  # a step that is no number: damaged
    text = _printed(capsys)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text, text
    assert "\\x1b[31m1\\r\\x07" in text, text


def test_inspect_escapes_the_manifest_and_reads_no_markup(tiny_checkpoint, tmp_path, capsys):
    def change(m):
        m["strategy"] = f"{RED}ddp[link=https://example.invalid]here[/link]"
        m["torch_version"] = "\x1b]0;title\x07"

    step_dir = _with_manifest(tiny_checkpoint, tmp_path, change)
    assert cli(["ckpt", "inspect", str(step_dir)]) == 0
    text = _printed(capsys)
    assert "\x1b" not in text and "\x07" not in text, text
    assert "\\x1b[31mddp" in text and "[link=https://example.invalid]" in text, text


def test_a_refusal_in_one_line_escapes_the_name_it_quotes(tiny_checkpoint, tmp_path, capsys):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    name = f"{RED}rank.json"

    def change(m):
        m["files"][name] = {**next(iter(m["files"].values())), "size": 2}  # a well-formed record

    step_dir = _with_manifest(tiny_checkpoint, tmp_path, change)
    (step_dir / name).symlink_to(outside)  # a symlink out: `CheckpointUnsafe`, exit 2
    assert cli(["ckpt", "verify", str(step_dir)]) == 2
    text = _printed(capsys)
    assert "\x1b" not in text and "\\x1b[31mrank.json" in text and "refused" in text, text


@pytest.mark.parametrize("c", CONTROLS)
def test_shown_escapes_every_control_character(c):
    out = shown(f"a{c}b", lines=True)
    assert out.isprintable() and out.startswith("a") and out.endswith("b") and len(out) > 3
    assert shown("one\ntwo", lines=True) == "one\ntwo"
    assert shown("one\ntwo") == "one\\ntwo"
    assert shown("plain ünïcödé") == "plain ünïcödé"
