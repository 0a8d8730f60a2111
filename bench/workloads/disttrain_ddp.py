"""plain.py converted to disttrain, strategy "ddp" (`dt.wrap`, `dt.Accumulator`)."""

import torch
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model
from torch.utils.data import DataLoader

import disttrain as dt


def main() -> None:
    bench = Bench()
    with dt.distributed(seed=0):
        data = make_dataset()
        sampler = dt.DistributedSampler(data, seed=0)
        loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
        model = dt.wrap(make_model(), strategy="ddp")
        optimizer = dt.make_optimizer(model, torch.optim.AdamW, lr=3e-4)
        acc = dt.Accumulator(model, optimizer, accum_steps=ACCUM_STEPS, grad_clip=1.0)
        for x, y in loader:
            with acc.micro_step():
                _, loss = model(x, y)
                acc.backward(loss)
            if acc.stepped and bench.step(loss):
                break
        dt.print_main(f"loss {dt.global_mean(loss.item(), 1):.4f}")
        bench.finish()


if __name__ == "__main__":
    main()
