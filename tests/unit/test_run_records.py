"""What a run records about itself (train/run_summary.py, train/evaluation.py): the
summary's wall time is the attempts' own time, not the idle days between them; an
evaluation runs without gradients in eval mode and leaves its values in
`evaluator.last`."""

from __future__ import annotations

import json
import time

import torch
from torch.utils.data import TensorDataset

import disttrain as dt
from disttrain.train import run_summary


def test_wall_time_sums_the_attempts_and_leaves_out_the_idle_days_between(tmp_path):
    days_ago = time.time() - 3 * 86400  # the run started three days ago, resumed today
    (tmp_path / run_summary.START).write_text(json.dumps({"time": days_ago, "heldout": {}}))
    run_summary.record_attempt_time(tmp_path, 0, 4.0)
    run_summary.record_attempt_time(tmp_path, 0, 5.0)  # the killed attempt's last record
    summary = run_summary.build(tmp_path, steps=8, world_size=1, strategy="ddp", attempt_t0=time.perf_counter(),
                                samples_per_step=4, tokens_per_sample=0, final={}, resumed=True, attempt=1)
    assert 5.0 <= summary["wall_time_s"] < 3600
    assert summary["wall_time_s"] - summary["attempt_wall_time_s"] == 5.0


def test_an_evaluation_runs_without_gradients_in_eval_mode_and_keeps_its_values(tmp_path):
    seen = []

    def metric(model, batch):
        seen.append((torch.is_grad_enabled(), model.training))
        (x,) = batch
        return {"loss": model(x).pow(2).mean(), "size": (float(len(x)), 1.0)}

    data = TensorDataset(torch.randn(16, 2))
    with dt.Job(tmp_path, progress=False, tensorboard=False) as job:
        model = job.wrap(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = job.loader(data, batch_size=4)
        evaluator = job.evaluator(data, batch_size=4, metric=metric)
        assert isinstance(evaluator, dt.Evaluator) and evaluator.last == {}
        job.resume(model=model, optimizer=opt)
        for (x,) in job.steps(loader, max_steps=2):
            job.backward(model(x).pow(2).mean())
    assert seen and set(seen) == {(False, False)}
    assert model.training
    assert set(evaluator.last) == {"loss", "size"} and evaluator.last["size"] == 4.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["heldout_loss"] == evaluator.last["loss"]
