"""plain.py converted to disttrain's `dt.Job` (resumable: checkpoints, exactly-once data,
SIGTERM handling), strategy "ddp". The window test `(i + 1) % ACCUM_STEPS` stays valid:
a job (re)starts at an optimizer-step boundary, so `i` counts from a window's start."""

import torch
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model

import disttrain as dt


def main() -> None:
    bench = Bench()
    with dt.Job("runs/bench_job", accum_steps=ACCUM_STEPS, grad_clip=1.0, checkpoint_every=0) as job:
        torch.manual_seed(0)
        data = make_dataset()
        loader = job.loader(data, batch_size=BATCH_SIZE)
        model = job.wrap(make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        job.resume(model=model, optimizer=optimizer)
        for i, (x, y) in enumerate(job.steps(loader, max_steps=10**6)):
            _, loss = model(x, y)
            job.backward(loss)
            if (i + 1) % ACCUM_STEPS == 0:
                if bench.step(loss):
                    break
        dt.print_main(f"loss {dt.global_mean(loss.item(), 1):.4f}")
        bench.finish()


if __name__ == "__main__":
    main()
