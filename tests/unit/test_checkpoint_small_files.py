"""The small files of a save (RNG, `state.json`, `.metadata`) are written and fsynced
off the save's path, and still every one is on disk before the commit: a failure to
write one fails the save, leaves no temporary directory, and the previous checkpoint
stays latest (P-CKPT-2)."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import torch.nn as nn

import disttrain.checkpoint.checkpointer as checkpointer
import disttrain.checkpoint.files as files
from disttrain.checkpoint import Checkpointer, CheckpointSaveError, TrainState, step_folders


def _state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_every_small_file_is_listed_and_verifies(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=0)
    state = _state()
    state.step = 1
    step_dir = ck.save(state)
    manifest = step_folders.verify(step_dir)
    assert {".metadata", "state.json", "rank-00000.json"} <= set(manifest["files"])
    assert json.loads((step_dir / "state.json").read_text())["step"] == 1
    ck.close()


def test_every_file_of_a_checkpoint_is_readable_by_its_owner_only(tmp_path):
    """The weights and DCP's metadata were written 0644 (other users on the machine
    could read them) while the manifest and state.json were 0600."""
    ck = Checkpointer(tmp_path, keep_last=0)
    state = _state()
    state.step = 1
    step_dir = ck.save(state)
    ck.close()
    modes = {p.name: p.stat().st_mode & 0o777 for p in step_dir.iterdir()}
    assert any(name.endswith(".distcp") for name in modes) and ".metadata" in modes, modes
    assert set(modes.values()) == {0o600}, modes


@pytest.mark.parametrize("broken", ["rank-00000.json", "state.json", ".metadata"])
def test_a_small_file_that_cannot_be_written_fails_the_save(tmp_path, monkeypatch, broken):
    ck = Checkpointer(tmp_path, keep_last=0)
    state = _state()
    state.step = 1
    first = ck.save(state)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_write, real_sync = checkpointer.atomic_write_bytes, files.fsync_file
    monkeypatch.setattr(checkpointer, "atomic_write_bytes",
                        lambda data, path: full(path) if path.name == broken else real_write(data, path))
    import disttrain.checkpoint.raw_storage as raw_storage

    monkeypatch.setattr(raw_storage, "fsync_file",
                        lambda path: full(path) if path.name == broken else real_sync(path))
    state.step = 2
    with pytest.raises(CheckpointSaveError, match="disk full") as info:
        ck.save(state)
    assert "step-00000001 stays the latest" in str(info.value)
    assert [p for _, _, p in step_folders.committed(tmp_path)] == [first]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    ck.close()
