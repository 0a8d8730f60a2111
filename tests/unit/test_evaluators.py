"""Several evaluators per job (train/job.py, train/evaluation.py): each with its own name
prefix in metrics.jsonl and TensorBoard, each at its own period and at the last step;
a repeated or malformed name is one `UserError`. One process: the metrics are global
means whatever the world size (tests/faults/test_job_user_path.py covers the sharding)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

import disttrain as dt
from disttrain.errors import UserError


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _mse(model, batch):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def test_two_evaluators_each_with_its_prefix_and_period(tmp_path):
    train = _data(64, 0)
    with dt.Job(tmp_path, checkpoint_every=0, progress=False) as job:
        model = job.wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = job.loader(train, batch_size=8)
        val = job.evaluator(_data(32, 1), batch_size=8, every=2, metric=_mse)
        on_train = job.evaluator(train, batch_size=8, every=3, max_batches=2, metric=_mse, name="train_sample")
        with pytest.raises(UserError, match=r"name='train_sample'.*taken: 'heldout', 'train_sample'"):
            job.evaluator(train, batch_size=8, name="train_sample")
        with pytest.raises(UserError, match="lowercase identifier"):
            job.evaluator(train, batch_size=8, name="Val loss")
        job.resume(model=model, optimizer=opt)
        for x, y in job.steps(loader, max_steps=7):
            loss = torch.nn.functional.mse_loss(model(x), y)
            job.backward(loss)
            job.log(loss=loss)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    held = [r["step"] for r in records if "heldout_loss" in r]
    sampled = [r["step"] for r in records if "train_sample_loss" in r]
    assert held == [2, 4, 6, 7] and sampled == [3, 6, 7]  # each its period, both at the last step
    last = records[-1]
    assert last["heldout_loss"] == val.last["loss"] and last["train_sample_loss"] == on_train.last["loss"]
    assert last["heldout_loss"] != last["train_sample_loss"]  # two eval sets, two numbers
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_heldout_loss"] == val.last["loss"]
    assert summary["final_train_sample_loss"] == on_train.last["loss"]


def test_an_evaluator_named_train_is_refused_so_the_loops_loss_keeps_its_name(tmp_path):
    """`train_loss`, `final_train_loss` and TensorBoard's `loss/train` are the loop's own
    loss; an evaluator named "train" would write its loss under the same names."""
    with dt.Job(tmp_path, checkpoint_every=0, progress=False) as job:
        job.wrap(torch.nn.Linear(4, 1))
        with pytest.raises(UserError, match=r"name='train'.*training loop's own.*name='train_sample'"):
            job.evaluator(_data(16, 0), batch_size=8, name="train")
        assert job.evaluators == []
