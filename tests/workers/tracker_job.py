"""A dt.Job script that sends its run to W&B (offline) and MLflow (a file store under
OUT/mlruns) (tests/faults/test_trackers.py).

    tracker_job.py OUT STEPS
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import disttrain as dt


def main(out: Path, steps: int) -> None:
    trackers = [dt.WandbTracker(project="tracker-test", mode="offline"),
                dt.MlflowTracker(experiment="tracker-test", tracking_uri=(out / "mlruns").resolve().as_uri())]
    with dt.Job(out, checkpoint_every=4, trackers=trackers, tensorboard=False, progress=False) as job:
        model = job.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g))
        loader = job.loader(data, batch_size=4)
        job.resume(model=model, optimizer=opt)
        for x, y in job.steps(loader, max_steps=steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            job.backward(loss)
            job.log(loss=loss)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
