"""Messages in the user's words: the prefix is the way in ('disttrain
job' in a script, 'disttrain train' in the trainer); `dt.print_main` prints once before a
Job exists; losses are labelled in the data's unit; a finished run says only that it is
finished and what a continued run would change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_disttrain
from torch.utils.data import TensorDataset

import disttrain as dt
from disttrain.builtin import MLP, MLPConfig
from disttrain.config import load_config
from disttrain.runtime import log
from disttrain.train.progress import print_summary
from disttrain.train.trainer import loss_unit


def _run_job(out, lr: float, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    with dt.Job(out, checkpoint_every=0) as job:
        model = job.wrap(MLP(MLPConfig()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        loader = job.loader(data, batch_size=8)
        job.resume(model=model, optimizer=optimizer)
        for x, y in job.steps(loader, max_steps=steps):
            job.backward(model(x, y)[1])


def test_a_finished_job_says_it_is_finished_and_what_a_continuation_would_change(tmp_path, capsys):
    _run_job(tmp_path, lr=1e-2)
    capsys.readouterr()
    _run_job(tmp_path, lr=2e-2)
    out = capsys.readouterr()
    text = out.out + out.err
    lines = [line for line in text.splitlines() if line.startswith("disttrain")]
    assert lines == ["disttrain job: complete at step 3; nothing to train: raise max_steps (3) to continue, "
                     "or use another out_dir. Continued, it would apply the changes since the checkpoint: "
                     "optim.lr 0.01 -> 0.02."], text
    assert "(applied)" not in text and "resumed at" not in text


def test_a_resumed_job_says_so_in_job_words_with_the_applied_changes(tmp_path, capsys):
    _run_job(tmp_path, lr=1e-2, steps=2)
    capsys.readouterr()
    _run_job(tmp_path, lr=2e-2, steps=4)
    out = capsys.readouterr()
    assert "disttrain job: resumed at step 2" in out.err
    assert "disttrain job: config changed since the checkpoint (applied)" in " ".join(out.out.split())
    assert "disttrain train" not in out.out + out.err


def test_the_speaker_is_the_way_in():
    """Fast recovery's and the buddy copy's messages take their prefix from here."""
    dt.Job("unused-dir")
    assert log.speaker() == "disttrain job"
    dt.Job("unused-dir", run=dt.RunOptions(stored_config={"train": {}}))  # how the trainer makes its Job
    assert log.speaker() == "disttrain train"


def test_print_main_before_the_job_prints_once_per_job(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import disttrain as dt\ndt.print_main('said before any Job')\n")
    proc = run_disttrain(["run", "--nproc", "2", str(script)], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("said before any Job") == 1, proc.stdout


def test_loss_unit_follows_the_data(tmp_path):
    assert loss_unit(load_config(None)) == "nats/byte"
    assert loss_unit(load_config(None, ["--data.tokens=x.bin"])) == "nats/token"
    assert loss_unit(load_config(None, ["--model.factory=m:f", "--data.factory=m:d"])) == ""


@pytest.mark.parametrize("unit", ["nats/token", ""])
def test_the_summary_labels_losses_with_the_runs_unit(capsys, unit):
    print_summary({"strategy": "ddp", "world_size": 1, "steps": 2, "samples_seen": 8, "wall_time_s": 1.0,
                   "initial_heldout_loss": 3.0, "final_train_loss": 2.0, "final_heldout_loss": 2.5,
                   "checkpoint": "model.pt", "unit": "token", "loss_unit": unit})
    out = capsys.readouterr().out
    assert "nats/byte" not in out and (f"({unit})" in out) == bool(unit)


@pytest.mark.slow
def test_a_token_file_run_reports_nats_per_token(tmp_path):
    np.arange(4000, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(tmp_path / "train.bin")
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", f"--data.tokens={tmp_path / 'train.bin'}",
                          "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=16",
                          "--train.batch_size=4", "--train.steps=2", "--train.eval_every=0",
                          "--train.eval_batches=1", "--parallel.nproc=1", "--guard.enabled=false",
                          f"--train.out_dir={tmp_path / 'out'}"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final train loss (nats/token)" in proc.stdout and "nats/byte" not in proc.stdout, proc.stdout
