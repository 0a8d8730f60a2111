"""A checkpoint's files are opened once: what is checked is what is read (docs/security.md,
"Check, then reopen").

The folder's author swaps a file between the check and the read, as they could on a
shared file system: a hook runs right after the check, and replaces the checked file
with a symlink to a private file of the reader's. The read must refuse it, one line
naming the file, and no byte of the private file may reach the state or an export.
"""

import os
import sys

import pytest
import torch
from conftest import WORKERS, checkpoint_copy

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, train  # noqa: E402

from disttrain.checkpoint import Checkpointer, CheckpointUnsafe, hashing_fs, step_folders  # noqa: E402
from disttrain.checkpoint import export as export_module  # noqa: E402
from disttrain.cli import main as cli  # noqa: E402
from disttrain.plain_files import NotPlainFile, open_plain, read_plain  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _swap_for_symlink(step_dir, name, private):
    """What the author does between the check and the read: `name` becomes a symlink
    to `private`, a file of the same size holding bytes the author wants to see."""
    private.write_bytes(b"S" * (step_dir / name).stat().st_size)
    (step_dir / name).unlink()
    (step_dir / name).symlink_to(private)


def _after_first(monkeypatch, module, attr, then):
    """Make `module.attr` run `then()` once, right after its first call returned."""
    original, calls = getattr(module, attr), []

    def hooked(*args, **kwargs):
        out = original(*args, **kwargs)
        if not calls:
            calls.append(1)
            then()
        return out

    monkeypatch.setattr(module, attr, hooked)


@pytest.mark.parametrize("name, checked_by", [
    ("state.json", "load_one"),  # every check of the load is done: the hand-over reads it
    ("__0_0.distcp", "check_files"),  # the small files are checked: the reads come next
])
def test_a_load_refuses_a_file_swapped_for_a_symlink_after_its_check(
    tiny_checkpoint, tmp_path, monkeypatch, name, checked_by
):
    root, step_dir = checkpoint_copy(tiny_checkpoint, tmp_path)
    private = tmp_path / "private"
    _after_first(monkeypatch, hashing_fs, checked_by, lambda: _swap_for_symlink(step_dir, name, private))
    state = build("ddp")
    with pytest.raises(CheckpointUnsafe) as e:
        Checkpointer(root).load(state)
    assert name in str(e.value) and "symlink" in str(e.value)
    assert "\n" not in str(e.value)
    assert state.step == 0  # nothing of the swapped file was handed over


def test_an_export_refuses_a_shard_swapped_for_a_symlink_after_verify(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    root, step_dir = checkpoint_copy(tiny_checkpoint, tmp_path)
    private = tmp_path / "private"
    _after_first(
        monkeypatch, export_module.step_folders, "verify", lambda: _swap_for_symlink(step_dir, "__0_0.distcp", private)
    )
    out = tmp_path / "model.safetensors"
    assert cli(["ckpt", "export", str(step_dir), "--to", str(out)]) == 2
    err = capsys.readouterr().err
    assert "__0_0.distcp" in err and "symlink" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_verify_hashes_and_sizes_each_file_on_the_descriptor_it_opened(tiny_checkpoint, tmp_path, monkeypatch):
    """Every file verify checks is opened once, by `open_own`, never by its name again."""
    root, step_dir = checkpoint_copy(tiny_checkpoint, tmp_path)
    opened = []
    real_open = os.open

    def counting(path, flags, *args, **kwargs):
        if str(path).startswith(str(step_dir)):
            opened.append((os.path.basename(path), bool(flags & os.O_NOFOLLOW)))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    manifest = step_folders.verify(step_dir)
    names = [n for n, _ in opened if n != step_folders.MANIFEST]
    assert sorted(names) == sorted(manifest["files"])  # each listed file once
    assert all(nofollow for _, nofollow in opened)


def test_a_symlink_inside_the_folder_is_refused_too(tiny_checkpoint, tmp_path, capsys):
    """disttrain never writes a symlink into a checkpoint: one that stays inside the
    folder is no more trusted than one out of it."""
    root, step_dir = checkpoint_copy(tiny_checkpoint, tmp_path)
    (step_dir / "state.json").rename(step_dir / "state.copy")
    (step_dir / "state.json").symlink_to("state.copy")
    assert cli(["ckpt", "verify", str(step_dir)]) == 2
    err = capsys.readouterr().err
    assert "state.json is a symlink" in err and "Traceback" not in err


def test_open_plain_checks_the_open_descriptor(tmp_path):
    regular = tmp_path / "a.json"
    regular.write_bytes(b"{}")
    with open_plain(regular, 10) as f:
        assert f.read() == b"{}"
    link = tmp_path / "link"
    link.symlink_to(regular)
    with pytest.raises(NotPlainFile, match="is a symlink"):
        open_plain(link, 10)
    assert read_plain(link, 10, follow=True) == b"{}"  # where a caller follows on purpose
    with pytest.raises(NotPlainFile, match="is a folder, not a regular file"):
        open_plain(tmp_path, 10)
    with pytest.raises(NotPlainFile, match="holds 2 bytes, more than the 1"):
        read_plain(regular, 1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotPlainFile, match="is a FIFO"):  # at once: no writer is waited for
        read_plain(fifo, 10)
    with pytest.raises(FileNotFoundError):
        open_plain(tmp_path / "missing", 10)


def test_a_load_of_an_untouched_checkpoint_still_matches(tiny_checkpoint, tmp_path):
    root, _ = checkpoint_copy(tiny_checkpoint, tmp_path)
    state = build("ddp")
    assert Checkpointer(root).load(state) is not None
    assert state.step == 1
    again = build("ddp")
    train(again, 1)
    for a, b in zip(state.model.parameters(), again.model.parameters(), strict=False):
        assert torch.equal(a, b)
