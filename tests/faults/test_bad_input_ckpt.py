"""Issue 22, the checkpoint side: nothing a user types or copies destroys a checkpoint.

Each test names its item: 1 (export never clobbers), 2 (retention keeps the newest
finite checkpoint; `check_finite`), 4 (step identity from the manifest), 5 (a damaged
checkpoint is kept aside), 8 (disk full names the failing rank), 12 (a stray empty
step folder). One process and real files, except item 8 (two gloo ranks).
"""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, WORKERS, run_cmd, worker_env

sys.path.insert(0, str(WORKERS))
from ckpt_common import build, train  # noqa: E402

from disttrain.checkpoint import CheckpointCorrupt, Checkpointer, NonFiniteError, check_finite, verify  # noqa: E402
from disttrain.checkpoint.step_folders import committed  # noqa: E402
from disttrain.cli import main as cli  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Steps 1, 2, 3 of one run (keep_last = 3)."""
    root = tmp_path_factory.mktemp("bad_ckpt") / "ckpt"
    state = build("ddp")
    ck = Checkpointer(root, keep_last=3)
    for _ in range(3):
        train(state, 1)
        ck.save(state)
    return root


def _copy(three, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(three, dst)
    return dst


def test_1_export_refuses_to_overwrite_any_existing_path(three, tmp_path, capsys):
    root = _copy(three, tmp_path)
    shard = next((root / "step-00000003").glob("*.distcp"))
    before = shard.read_bytes()
    for target in (shard, root / "WRITER.json", tmp_path):  # a shard, a file, a directory
        assert cli(["ckpt", "export", str(root), "--to", str(target)]) == 2
    err = capsys.readouterr().err
    assert "already exists and would be overwritten" in err and "is a directory" in err
    assert "Traceback" not in err
    assert shard.read_bytes() == before
    verify(root / "step-00000003")
    out = tmp_path / "model.safetensors"  # an earlier export of its own may be replaced
    assert cli(["ckpt", "export", str(root), "--to", str(out)]) == 0
    assert cli(["ckpt", "export", str(root), "--to", str(out)]) == 0


def test_2_retention_never_deletes_the_newest_finite_checkpoint(three, tmp_path):
    root = _copy(three, tmp_path)
    state = build("ddp")
    ck = Checkpointer(root, keep_last=3)
    ck.load(state)
    with torch.no_grad():
        for p in state.model.parameters():
            p.fill_(float("nan"))  # what an infinite learning rate does
    for _ in range(3):
        state.step += 1
        ck.save(state)
    names = [p.name for _, _, p in committed(root)]
    assert names == ["step-00000006", "step-00000005", "step-00000004", "step-00000003"]
    manifests = {n: json.loads((root / n / "manifest.json").read_text()) for n in names}
    assert manifests["step-00000003"]["finite"] is True
    assert all(manifests[f"step-0000000{s}"]["finite"] is False for s in (4, 5, 6))


def test_2_check_finite_names_the_step():
    check_finite(torch.tensor(2.5), step=3)
    check_finite(1.0, step=3)
    check_finite(torch.nn.Linear(2, 2), step=3)
    with pytest.raises(NonFiniteError, match=r"^step 7: the loss is not finite") as err:
        check_finite(torch.tensor(float("nan")), step=7)
    assert err.value.step == 7 and "\n" not in str(err.value)
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.bias[0] = float("inf")
    with pytest.raises(NonFiniteError, match="step 9: tensor 'bias' is not finite"):
        check_finite(layer, step=9)
    with pytest.raises(NonFiniteError, match=r"step 2: the loss \(inf\)"):
        check_finite(float("inf"), step=2)


def test_4_a_copy_under_a_later_step_name_is_not_trusted(three, tmp_path, capsys):
    root = _copy(three, tmp_path)
    fake = root / "step-00000010"
    shutil.copytree(root / "step-00000002", fake)
    with pytest.raises(CheckpointCorrupt, match="holds step 2 by its manifest"):
        verify(fake)
    assert cli(["ckpt", "verify", str(fake)]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert committed(root)[0][2].name == "step-00000003"  # what a resume picks
    state = build("ddp")
    ck = Checkpointer(root, keep_last=2)
    assert ck.load(state).name == "step-00000003" and state.step == 3
    train(state, 1)
    ck.save(state)  # retention after this commit keeps the copy and only prunes real ones
    assert fake.is_dir() and (root / "step-00000003").is_dir() and (root / "step-00000004").is_dir()


def test_5_a_damaged_checkpoint_skipped_by_fallback_is_kept_aside(three, tmp_path):
    root = _copy(three, tmp_path)
    shard = next((root / "step-00000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    state = build("ddp")
    ck = Checkpointer(root, keep_last=3, fallback=True)
    assert ck.load(state).name == "step-00000002"
    train(state, 1)
    ck.save(state)  # step 3 again: the damaged one must be moved aside, not deleted
    kept = list(root.glob(".corrupt-step-00000003-*"))
    assert len(kept) == 1 and bytes(data) in [p.read_bytes() for p in kept[0].glob("*.distcp")]
    verify(root / "step-00000003")


def test_12_a_stray_empty_step_folder_does_not_block_a_resume(three, tmp_path, capsys):
    root = _copy(three, tmp_path)
    (root / "step-99999999").mkdir()
    state = build("ddp")
    assert Checkpointer(root).load(state).name == "step-00000003"
    assert "step-99999999 is an empty folder, not a checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointCorrupt, match="is an empty folder, not a checkpoint"):
        verify(root / "step-99999999")


WORKER = textwrap.dedent("""
    import sys
    import disttrain as dt
    from ckpt_common import build, train
    from disttrain.checkpoint import Checkpointer, CheckpointSaveError
    dt.init(backend="gloo", device="cpu")
    state = build("ddp")
    ck = Checkpointer(sys.argv[1])
    train(state, 1)
    try:
        ck.save(state)
    except CheckpointSaveError as e:
        # one write per line: two ranks share the pipe, and print's separate newline interleaves
        sys.stdout.write(f"RANK{dt.rank_info().rank}: {e}\\n")
        sys.stdout.flush()
    dt.shutdown()
""")


def test_8_disk_full_names_the_rank_whose_disk_is_full(tmp_path):
    script = tmp_path / "save_once.py"
    script.write_text(WORKER)
    env = worker_env(DISTTRAIN_FAULT="enospc@checkpoint.shards:rank=1,step=1")
    proc = subprocess.run(run_cmd(2, str(script), str(tmp_path / "ckpt")),
                          capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RANK")]
    assert len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    assert all("rank 1: disk full" in ln and "rank 0: disk full" not in ln for ln in lines), lines
