"""A small `dt.Job` script whose program fails, or that holds a TCP connection of its own
(tests/faults/test_failure_kinds.py).

    failing_job.py OUT [--steps N] [--raise-at STEP] [--raise-rank R]
                       [--kind KIND] [--tcp PORT] [--timeout-s S]

`--raise-at STEP`: rank R raises at that step in every attempt (-1: after resume, before
the first step): "runtime" RuntimeError("shapes do not match"), "oom"
torch.OutOfMemoryError, "hostoom" MemoryError (the program's errors), "timeout" a
TimeoutError (which cannot be classified); the program's deaths: "segv" a native crash,
"abort" `os.abort()`, "exit" `sys.exit(3)`, "return" rank R's main() returns, "interrupt"
a KeyboardInterrupt, "mismatch" an all_reduce on rank R alone; "sleep" a rank that stops
making progress. `--tcp PORT`: the process of RANK 0 sends "step N" after every step and
"done" at the end on its one connection to 127.0.0.1:PORT (tests/workers/tracker.py),
opened before the first step. Rank 0 appends a line to OUT/starts.log at each start of
the job (each attempt, each generation).
"""

import argparse
import ctypes
import multiprocessing
import os
import signal
import sys
import time

import torch

import disttrain as dt
from disttrain.config import Config, GuardConfig, ParallelConfig


def fail(kind: str, step: int, rank: int):
    if kind == "segv":  # a native crash: what a faulty extension does
        ctypes.string_at(0)
    if kind == "abort":
        os.abort()
    if kind == "exit":
        sys.exit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "mismatch":  # a collective no peer enters: gloo ends this rank
        torch.distributed.all_reduce(torch.ones(3))
    if kind == "sleep":
        time.sleep(3600)
    if kind == "loaderkill":  # what the kernel's OOM killer does to a loader worker, once
        if not os.path.exists(marker := f"{os.environ.get('OUT_DIR', '.')}/loader-killed"):
            open(marker, "w").close()
            os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        return
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (step {step})")
    if kind == "hostoom":
        raise MemoryError()
    if kind == "timeout":  # whose? a collective's or the user's: retried until it repeats
        raise TimeoutError("timed out waiting for the data service")
    raise RuntimeError("shapes do not match")


def main(a):
    os.environ["OUT_DIR"] = a.out
    g = torch.Generator().manual_seed(0)  # the same data in every run and on every rank
    data = torch.utils.data.TensorDataset(torch.randn(1024, 8, generator=g), torch.randn(1024, 1, generator=g))
    tracked = a.tcp and os.environ.get("RANK") == "0"
    if tracked:
        import tracker

        tracker.send(a.tcp, "start")
    config = Config(parallel=ParallelConfig(timeout_s=a.timeout_s))
    if a.hang_s:  # test-sized hang bounds, tick and all
        config = Config(
            parallel=config.parallel, guard=GuardConfig(hang_min_s=a.hang_s, hang_cap_s=a.hang_s, tick_s=0.25)
        )
    with dt.Job(a.out, config, checkpoint_every=4, progress=False) as job:
        if job.info.rank == 0:
            os.makedirs(a.out, exist_ok=True)
            with open(f"{a.out}/starts.log", "a") as f:
                f.write("start\n")
        model = job.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = job.loader(data, batch_size=8, num_workers=a.workers)
        job.resume(model=model, optimizer=opt)
        if a.raise_at == -1 and job.info.rank == a.raise_rank:
            fail(a.kind, 0, job.info.rank)
        for x, y in job.steps(loader, max_steps=a.steps):
            if job.step + 1 == a.raise_at and job.info.rank == a.raise_rank:
                if a.kind == "return":  # this rank leaves its loop and ends; its peers go on
                    return
                fail(a.kind, job.step + 1, job.info.rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            job.backward(loss)
            if tracked:
                tracker.send(a.tcp, f"step {job.step}")
        if tracked:
            tracker.send(a.tcp, "done")
        dt.print_main(f"done at step {job.step}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--raise-at", type=int, default=0)
    ap.add_argument("--raise-rank", type=int, default=1)
    ap.add_argument("--kind", default="runtime")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=0.0)
    ap.add_argument("--tcp", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    main(ap.parse_args())
