"""Checkpoint checks in one process (world 1, real files): corruption, incompatible
models, writer fencing, the `disttrain ckpt` commands and the safetensors export
(P-CKPT-2,4,5, P-ELASTIC-5)."""

import hashlib
import json
import shutil
import sys

import pytest
import torch
from conftest import WORKERS

sys.path.insert(0, str(WORKERS))
import dataclasses  # noqa: E402

from ckpt_common import CFG, build, full_state, mismatches, train  # noqa: E402

from disttrain.builtin import GPT  # noqa: E402
from disttrain.checkpoint import (  # noqa: E402
    CheckpointCorrupt,
    Checkpointer,
    CheckpointMismatch,
    StaleWriterError,
    latest_valid,
    verify,
)
from disttrain.cli import main as cli  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of one run; tests corrupt copies of it."""
    root = tmp_path_factory.mktemp("local") / "run"
    state = build("ddp")
    ck = Checkpointer(root, keep_last=0)
    for _ in range(2):
        train(state, 1)
        ck.save(state)
    return root, full_state(state)


def _copy(saved, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(saved[0], dst)
    return dst, dst / "step-00000002"


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flip_shard": (lambda d: _flip_byte(next(d.glob("*.distcp"))), ".distcp"),
    "truncate_state": (lambda d: (d / "state.json").write_bytes((d / "state.json").read_bytes()[:10]),
                       "state.json"),
    "delete_metadata": (lambda d: (d / ".metadata").unlink(), ".metadata"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_named_refused_and_falls_back_only_when_asked_P_CKPT_5(saved, tmp_path, kind):
    root, step2 = _copy(saved, tmp_path)
    damage, name = CORRUPTIONS[kind]
    damage(step2)
    with pytest.raises(CheckpointCorrupt) as err:
        verify(step2)
    assert name in err.value.bad_file
    with pytest.raises(CheckpointCorrupt, match="Refusing to load step-00000002.*fallback"):
        Checkpointer(root).load(build("ddp"))
    state = build("ddp")
    assert Checkpointer(root, fallback=True).load(state).name == "step-00000001"
    assert state.step == 1
    assert latest_valid(root).name == "step-00000001"


def _as_older_version(step_dir):
    """Rewrite the manifest as versions before xxh3 wrote it: {"size", "sha256"} per file."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {name: {"size": rec["size"],
                                "sha256": hashlib.sha256((step_dir / name).read_bytes()).hexdigest()}
                         for name, rec in manifest["files"].items()}
    path.write_text(json.dumps(manifest))


def test_an_older_sha256_manifest_still_loads_and_still_catches_a_flipped_byte(saved, tmp_path):
    root, step2 = _copy(saved, tmp_path)
    assert all(r["digest"].startswith("xxh3_128:") for r in verify(step2)["files"].values())
    _as_older_version(step2)
    state = build("ddp")
    assert Checkpointer(root).load(state).name == "step-00000002"
    assert mismatches(full_state(state), saved[1]) == []
    shard = next(step2.glob("*.distcp"))
    _flip_byte(shard)
    with pytest.raises(CheckpointCorrupt, match=f"{shard.name} fails its sha256 checksum.*Refusing"):
        Checkpointer(root).load(build("ddp"))


def _truncate_manifest(step_dir):
    manifest = step_dir / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])


def test_unreadable_newest_manifest_is_refused_named_and_never_pruned_P_CKPT_5(saved, tmp_path, capsys):
    root, step2 = _copy(saved, tmp_path)
    _truncate_manifest(step2)
    with pytest.raises(CheckpointCorrupt) as err:
        Checkpointer(root).load(build("ddp"))  # not silently passed over for step 1
    assert "step-00000002" in str(err.value) and "manifest.json is unreadable" in str(err.value)
    assert cli(["ckpt", "verify", str(root)]) == 1
    assert "step-00000002" in capsys.readouterr().out
    state = build("ddp")
    ck = Checkpointer(root, keep_last=1, fallback=True)
    assert ck.load(state).name == "step-00000001" and state.step == 1
    assert "skipped corrupt checkpoint step-00000002" in capsys.readouterr().err
    train(state, 2)
    assert ck.save(state).name == "step-00000003"
    # retention kept the newest valid one and left the damaged one for inspection
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert Checkpointer(root).load(build("ddp")).name == "step-00000003"


def test_resave_over_an_unreadable_step_keeps_it_aside_for_inspection(saved, tmp_path):
    root, step2 = _copy(saved, tmp_path)
    _truncate_manifest(step2)
    state = build("ddp")
    ck = Checkpointer(root, keep_last=1, fallback=True)
    ck.load(state)
    train(state, 1)
    assert ck.save(state).name == "step-00000002"  # the same step, a new timeline
    verify(root / "step-00000002")
    aside = list(root.glob(".corrupt-step-00000002-*"))
    assert len(aside) == 1 and (aside[0] / ".metadata").is_file()


def test_cli_verify_names_the_first_bad_file(saved, tmp_path, capsys):
    root, step2 = _copy(saved, tmp_path)
    assert cli(["ckpt", "verify", str(step2)]) == 0 and "OK" in capsys.readouterr().out
    shard = next(step2.glob("*.distcp"))
    _flip_byte(shard)
    assert cli(["ckpt", "verify", str(root)]) == 1  # the root: its newest step is checked
    out = capsys.readouterr().out
    assert shard.name in out and "xxh3_128 checksum" in out


@pytest.mark.parametrize("change", [{"n_embd": 32}, {"bias": False}])
def test_incompatible_checkpoint_gives_one_short_message_P_CKPT_5(saved, change):
    state = build("ddp", cfg=dataclasses.replace(CFG, **change))
    with pytest.raises(CheckpointMismatch) as err:
        Checkpointer(saved[0]).load(state)
    msg = str(err.value)
    assert "mismatches" in msg and len(msg.splitlines()) <= 9
    assert ("shape" in msg) if "n_embd" in change else ("not in the model" in msg)


def test_a_refused_load_stops_its_prefetch(saved, monkeypatch):
    """The prefetch of the share starts before the compatibility check; a load that
    refuses (here: another model) stops it, and so does one that loads."""
    import disttrain.checkpoint.raw_read as raw_read

    stopped = []
    monkeypatch.setattr(raw_read, "stop_for", lambda d, inner=raw_read.stop_for: (stopped.append(d), inner(d)))
    with pytest.raises(CheckpointMismatch):
        Checkpointer(saved[0]).load(build("ddp", cfg=dataclasses.replace(CFG, n_embd=32)))
    assert stopped == [saved[0] / "step-00000002"]
    Checkpointer(saved[0]).load(build("ddp"))
    assert stopped[-1] == saved[0] / "step-00000002" and len(stopped) >= 2


def test_a_stale_writer_cannot_commit_or_become_latest_P_ELASTIC_5(tmp_path):
    root = tmp_path / "shared"
    old, new = build("ddp"), build("ddp")
    a = Checkpointer(root)
    train(old, 1)
    a.save(old)  # generation 1
    b = Checkpointer(root)  # a second job (split brain) on the same directory
    train(new, 1)
    b.save(new)  # generation 2 takes the lease; it re-commits step 1 over the old timeline
    train(old, 2)
    with pytest.raises(StaleWriterError, match="stale"):
        a.save(old)  # step 3 from the stale writer is refused
    assert latest_valid(root).name == "step-00000001"
    assert not (root / "step-00000003").exists()


def test_export_safetensors_loads_into_a_plain_model_strict_P_CKPT_4(saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert cli(["ckpt", "export", str(saved[0]), "--to", str(out),
                "--optim", str(tmp_path / "optim.pt")]) == 0
    weights = load_file(out)
    assert not any(k.startswith(("module.", "_fsdp", "model.")) for k in weights)
    plain = GPT(CFG)
    plain.load_state_dict(weights, strict=True)
    expect = {k[len("model."):]: v for k, v in saved[1].items() if k.startswith("model.")}
    assert mismatches(plain.state_dict(), expect) == []
    optim = torch.load(tmp_path / "optim.pt", weights_only=True)
    assert torch.equal(optim["state"]["tok_emb.weight"]["exp_avg"],
                       saved[1]["optim.tok_emb.weight.exp_avg"])


def test_inspect_prints_tensors_and_layout(saved, capsys):
    assert cli(["ckpt", "inspect", str(saved[0])]) == 0
    out = capsys.readouterr().out
    assert "model.tok_emb.weight" in out and "256x16" in out
    assert "step 2" in out and "world 1" in out


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert cli(["ckpt", "verify", str(tmp_path)]) == 2
    assert "holds no committed checkpoint" in capsys.readouterr().err


def test_a_fresh_start_leaves_the_optimizer_untouched(tmp_path):
    """No checkpoint yet: `load` returns None without building a state dict, whose
    optimizer-state initialisation (one zero-gradient step) would start Adam's step
    counter at 1 and shift every bias correction of the run."""
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from disttrain.checkpoint import TrainState

    assert Checkpointer(tmp_path / "empty").load(TrainState(model=model, optimizer=opt)) is None
    assert not opt.state
