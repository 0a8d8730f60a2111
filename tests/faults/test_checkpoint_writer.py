"""Re-saves, fencing and async failures of one writer, in one process (world 1, real
files, real DCP writes): the same live writer re-saving a step is a no-op, only a
fenced writer is stale, a stale writer stops even with on_error = 'continue', and a
failed async save never costs the next save (P-CKPT-2, P-ELASTIC-5)."""

import sys

import pytest
from conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, full_state, mismatches, train  # noqa: E402

from disttrain.checkpoint import (  # noqa: E402
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    StaleWriterError,
    latest_valid,
    verify,
)
from disttrain.runtime.fault_injection import set_faults  # noqa: E402
from disttrain.train.save_cadence import Saving  # noqa: E402


@pytest.fixture(autouse=True)
def _no_faults():
    set_faults(None)
    yield
    set_faults(None)


@pytest.mark.parametrize("mode", ["off", "thread"])
def test_same_live_writer_resaving_a_committed_step_is_a_noop(tmp_path, mode):
    root = tmp_path / "run"
    state = build("ddp")
    ck = Checkpointer(root, async_mode=mode)
    train(state, 1)
    first = ck.save(state) or ck.wait()  # a periodic save at step 1 ...
    again = ck.save(state)  # ... and the end-of-run save of the same step
    assert first == again == root / "step-00000001"
    assert ck.wait() is None  # nothing was left in flight
    verify(again)
    assert sorted(p.name for p in root.iterdir()) == ["WRITER.json", "step-00000001"]
    ck.close()


def test_only_a_fenced_writer_is_stale_even_for_a_resave(tmp_path):
    root = tmp_path / "run"
    state = build("ddp")
    a = Checkpointer(root)
    train(state, 1)
    a.save(state)
    Checkpointer(root).save(build("ddp"))  # a second job takes the lease (generation 2)
    with pytest.raises(StaleWriterError, match="took over this checkpoint directory"):
        a.save(state)  # the re-save of step 1 by the fenced writer is refused


def test_stale_writer_is_not_a_save_error():
    assert issubclass(StaleWriterError, CheckpointError)
    assert not issubclass(StaleWriterError, CheckpointSaveError)


@pytest.mark.parametrize("mode", ["off", "thread"])
def test_trainer_save_and_close_let_a_stale_writer_stop_the_run_with_on_error_continue(tmp_path, mode):
    root = tmp_path / "run"
    state = build("ddp")
    a = Checkpointer(root, async_mode=mode)
    train(state, 1)
    saving = Saving(a, state, None, on_error="continue")
    saving.save(1)
    a.wait()
    Checkpointer(root).save(build("ddp"))  # fenced by a second job
    train(state, 1)
    if mode == "off":
        with pytest.raises(StaleWriterError):
            saving.save(2)
    else:  # the stale commit fails on the background thread: finish() reports it
        saving.save(2)
        with pytest.raises(StaleWriterError):
            saving.finish(2)
    assert not (root / "step-00000002").exists()


def test_a_failed_async_save_does_not_skip_the_next_save(tmp_path):
    root = tmp_path / "run"
    state = build("ddp")
    ck = Checkpointer(root, async_mode="thread")
    train(state, 1)
    ck.save(state)
    set_faults("enospc@checkpoint.shards:step=2")
    train(state, 1)
    assert ck.save(state) is None  # fails on the background thread
    train(state, 1)
    with pytest.raises(CheckpointSaveError) as err:
        ck.save(state)  # step 3 (the end of the run) is saved, then step 2's failure raised
    msg = str(err.value)
    assert "step-00000002" in msg and "disk full" in msg
    assert "step-00000003 is now the latest checkpoint" in msg
    assert latest_valid(root).name == "step-00000003"
    assert not (root / "step-00000002").exists() and not list(root.glob(".tmp-*"))
    assert ck.wait() is None
    ck.close()


def test_trainer_on_error_continue_warns_after_the_next_async_save(tmp_path, capsys, caplog):
    root = tmp_path / "run"
    state = build("ddp")
    ck = Checkpointer(root, async_mode="thread")
    set_faults("enospc@checkpoint.shards:step=1")
    train(state, 1)
    saving = Saving(ck, state, None, on_error="continue")
    saving.save(1)
    train(state, 1)
    saving.save(2)
    saving.finish(2)  # step 2 is saved: only the close
    err = capsys.readouterr().err + caplog.text  # the "disttrain" logger's warning
    assert "step-00000001" in err and "disk full" in err and "Training continues" in err
    assert latest_valid(root).name == "step-00000002"


def test_async_saves_take_a_new_stager_when_torch_spends_one_per_copy(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its inner stager after each copy (found by
    `scripts/compat.sh 2.11.0`: the third async save raised `KeyError: <class 'type'>`).
    Emulated here on any release: each async save after the first must still write the
    state it was given."""
    from torch.distributed.checkpoint.staging import DefaultStager

    copy_once = DefaultStager.stage

    def stage_then_spend(self, *args, **kwargs):  # torch 2.11's behaviour
        staged = copy_once(self, *args, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "stage", stage_then_spend)
    root = tmp_path / "run"
    state = build("ddp")
    ck = Checkpointer(root, async_mode="thread")
    for _ in range(3):  # the whole state, then this rank's part twice with one stager
        train(state, 1)
        assert ck.save(state) is None
        ck.wait()
    ck.close()
    restored = build("ddp")
    assert Checkpointer(root).load(restored) == root / "step-00000003"
    assert mismatches(full_state(state), full_state(restored)) == []
