"""ZeRO-1 checkpoints (P-FSDP-9, P-CKPT-1): `disttrain train` under zero1 saves without
consolidating the optimizer, every parameter's optimizer state is stored exactly
once (by the rank that owns it), a resume at the same world size is bit-exact, and
the checkpoint loads into a plain (unsharded) optimizer too."""

import json
import shutil

import torch
from conftest import run_disttrain

from disttrain.builtin import GPT
from disttrain.checkpoint import Checkpointer, TrainState, latest_valid
from disttrain.checkpoint.storage_formats import read_metadata
from disttrain.config.schema import load_config

ZERO = ["--parallel.strategy=zero1", "--parallel.nproc=2", "--model.n_layer=1", "--model.n_embd=32",
        "--model.n_head=2", "--model.block_size=32", "--model.dropout=0.1",
        "--data.max_bytes=50000", "--train.steps=6", "--train.batch_size=4",
        "--train.eval_every=0", "--train.eval_batches=1", "--train.log_every=1",
        "--checkpoint.every=3", "--guard.enabled=false"]


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_zero1_checkpoint_saves_and_resumes_bit_exact(tmp_path):
    a = tmp_path / "a"
    first = run_disttrain(["train", "examples/tiny_gpt.toml", *ZERO, f"--train.out_dir={a}"], timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Traceback" not in first.stderr
    ckpts = a / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003", "step-00000006"]
    assert latest_valid(ckpts).name == "step-00000006"

    # every parameter's Adam state is in the checkpoint, written once, by its owner
    cfg = load_config("examples/tiny_gpt.toml", [o.removeprefix("--") for o in ZERO])
    plain = GPT(cfg.model)
    names = {n for n, _ in plain.named_parameters()}
    keys = read_metadata(ckpts / "step-00000003").state_dict_metadata
    for moment in ("exp_avg", "exp_avg_sq", "step"):
        assert {k[len("optim.state."):-len(moment) - 1] for k in keys
                if k.startswith("optim.state.") and k.endswith("." + moment)} == names

    # a job that died after step 3's checkpoint: the same command resumes exactly
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step-00000006")
    for name in ("metrics.jsonl", "model.pt", "summary.json"):
        (b / name).unlink()
    second = run_disttrain(["train", "examples/tiny_gpt.toml", *ZERO, f"--train.out_dir={b}"], timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step 3" in second.stdout + second.stderr
    assert sorted(_losses(b)) == [4, 5, 6]
    assert all(_losses(b)[s] == _losses(a)[s] for s in (4, 5, 6))
    wa = torch.load(a / "model.pt", weights_only=True)
    wb = torch.load(b / "model.pt", weights_only=True)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # the same checkpoint loads into a plain model and AdamW (world 1, resharded)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    state = TrainState(model=plain, optimizer=opt)
    assert Checkpointer(ckpts).load(state).name == "step-00000006" and state.step == 6
    assert all(torch.equal(plain.state_dict()[k], wa[k]) for k in wa)
    assert len(opt.state) == len(names) and all(float(s["step"]) == 6 for s in opt.state.values())
