"""A compiled `disttrain train` (train.compile = true, inductor) killed with kill -9
mid-run and resumed by the launcher's restart ends bit-identical to an uninterrupted
compiled run: the same final weights (model.pt) and the same losses for the steps
trained again.

Tiny GPT (1 layer x 32, dropout on, so the resumed RNG state matters), DDP on 2 gloo
ranks, 6 steps, a checkpoint every 2. Rank 1 is killed in step 5's backward; torchrun
(`--max-restarts 1`) restarts both ranks, which compile again and resume at step 4.
The uninterrupted run fills the inductor cache the killed run then reads, so only the
first run pays the C++ build (about 90 s of CPU in all on 2 cores: marked slow).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_disttrain, worker_env

STEPS, KILL = 6, "kill@backward:rank=1,step=5"
ARGS = ["train", "examples/tiny_gpt.toml", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2",
        "--model.block_size=32", "--model.dropout=0.1", "--data.max_bytes=24577", "--data.drop_last=true",
        "--train.batch_size=4", "--train.eval_every=0", "--train.eval_batches=1", "--train.log_every=1",
        "--optim.lr=0.01", f"--train.steps={STEPS}", "--checkpoint.every=2", "--train.compile=true",
        "--parallel.strategy=ddp", "--parallel.nproc=2", "--log.tensorboard=false"]


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}  # a step trained again: its last record


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_compiled_run_killed_and_restarted_ends_bit_identical(tmp_path):
    env = worker_env(TORCHINDUCTOR_COMPILE_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    first = run_disttrain([*ARGS, f"--train.out_dir={whole}", "--max-restarts", "0"], timeout=190, env=env)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    second = run_disttrain([*ARGS, f"--train.out_dir={killed}", "--max-restarts", "1"], timeout=190,
                           env=dict(env, DISTTRAIN_FAULT=KILL))
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-4000:]
    assert "disttrain fault: kill at backward, step 5, rank 1" in log
    assert "resumed at step 4" in log
    events = [json.loads(x) for x in (killed / "run_events.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["step"], e["resumed"]) for e in events] == [(0, 0, False), (1, 4, True)]
    assert sorted(_losses(killed)) == list(range(1, STEPS + 1))
    assert _losses(killed) == _losses(whole)  # steps 5 and 6 trained again, the same floats
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(killed / "model.pt", weights_only=True)
    assert sorted(a) == sorted(b) and not any("_orig_mod" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
