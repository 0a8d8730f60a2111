"""The single-device loop of examples/plain_to_ddp.py, converted with `dt.Job`.

The lines marked `# dt` are the whole change from the plain script. The job owns the
process group, checkpoints and resume (exactly-once data, bit-exact weights), the
per-step dropout seed, SIGTERM (an agreed stop, a save, exit 0) and the final save.

    python examples/plain_to_disttrain.py                                       # one process
    disttrain run --nproc 2 --max-restarts 3 examples/plain_to_disttrain.py     # two, restartable

Killed or preempted, the same command continues from the newest valid checkpoint.
Options: --out DIR (default runs/plain_to_disttrain), --steps N, --record-samples.
"""

import argparse

import torch
from torch.utils.data import TensorDataset

import disttrain as dt  # dt
from disttrain.builtin import MLP, MLPConfig


def make_data(n: int = 2048) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 4, generator=g))


def main(out: str, steps: int, record_samples: bool) -> None:
    with dt.Job(out, accum_steps=2, checkpoint_every=10, record_samples=record_samples) as job:  # dt
        data = make_data()
        loader = job.loader(data, batch_size=32)  # dt: ElasticSampler, resumable mid-epoch
        model = job.wrap(MLP(MLPConfig()))  # dt: DDP (a plain module in a world of 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after wrap
        job.resume(model=model, optimizer=optimizer)  # dt: newest valid checkpoint, if any
        for x, y in job.steps(loader, max_steps=steps):  # dt: seeds, commits, saves, SIGTERM
            _, loss = model(x, y)
            job.backward(loss)  # dt: no_sync until the window's last micro-batch, then step
        dt.print_main(f"done at step {job.step}; weights in {out}/model.pt")  # dt: rank 0 only


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="plain_to_ddp.py's loop on dt.Job")
    ap.add_argument("--out", default="runs/plain_to_disttrain")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--record-samples", action="store_true")
    a = ap.parse_args()
    main(a.out, a.steps, a.record_samples)
