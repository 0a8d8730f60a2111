"""A small `dt.Job` script whose program fails, or that holds a TCP connection of its own
(tests/test_failure_kinds.py).

    failing_job.py OUT [--steps N] [--raise-at STEP] [--raise-rank R] [--kind runtime|oom|hostoom]
                       [--tcp PORT]

`--raise-at`: rank R raises at that step ("runtime": RuntimeError("shapes do not match"),
"oom": torch.OutOfMemoryError, "hostoom": MemoryError), in every attempt: a program's
error, deterministic. `--tcp PORT`: rank 0 opens a connection to 127.0.0.1:PORT before
the job starts, sends "step N" on it after every step and "done" at the end.
"""

import argparse
import socket

import torch

import disttrain as dt


def fail(kind: str, step: int, rank: int):
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (step {step})")
    if kind == "hostoom":
        raise MemoryError()
    raise RuntimeError("shapes do not match")


def main(a):
    data = torch.utils.data.TensorDataset(torch.randn(1024, 8), torch.randn(1024, 1))
    with dt.Job(a.out, checkpoint_every=4, progress=False) as job:
        conn = None
        if a.tcp and job.info.rank == 0:
            conn = socket.create_connection(("127.0.0.1", a.tcp), timeout=30)
        model = job.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = job.loader(data, batch_size=8)
        job.resume(model=model, optimizer=opt)
        for x, y in job.steps(loader, max_steps=a.steps):
            if job.step + 1 == a.raise_at and job.info.rank == a.raise_rank:
                fail(a.kind, job.step + 1, job.info.rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            job.backward(loss)
            if conn is not None:
                conn.sendall(f"step {job.step}\n".encode())
        if conn is not None:
            conn.sendall(b"done\n")
            conn.close()
        dt.print_main(f"done at step {job.step}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--raise-at", type=int, default=0)
    ap.add_argument("--raise-rank", type=int, default=1)
    ap.add_argument("--kind", default="runtime")
    ap.add_argument("--tcp", type=int, default=0)
    main(ap.parse_args())
