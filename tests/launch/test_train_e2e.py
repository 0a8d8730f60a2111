"""End to end: `disttrain train` on 2 real gloo processes, a small config of the main job."""

import json

import torch
from conftest import run_disttrain

from disttrain.builtin import GPT, GPTConfig

SMALL = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
         "--data.max_bytes=200000", "--train.steps=30", "--train.batch_size=8",
         "--train.eval_every=0", "--train.eval_batches=4", "--train.log_every=5",
         "--optim.lr=0.01"]


def test_train_two_ranks_learns_and_writes_on_rank0_only(tmp_path):
    out = tmp_path / "run"
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", *SMALL, f"--train.out_dir={out}"],
                         timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["final_heldout_loss"] < summary["initial_heldout_loss"] - 1.0
    assert "run summary" in proc.stdout and "final held-out loss" in proc.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20, 25, 30]  # one writer: each step logged once (P-LOOP-1)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=32))
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in state)  # P-CKPT-4
    model.load_state_dict(state, strict=True)
