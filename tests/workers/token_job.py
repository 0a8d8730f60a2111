"""A dt.Job script on dt.TokenWindows, the way a nanoGPT user writes one
(tests/faults/test_token_windows.py).

    token_job.py OUT TOKENS STEPS
"""

import sys
from pathlib import Path

import torch
from token_model import build

import disttrain as dt


def main(out: Path, tokens: str, steps: int) -> None:
    with dt.Job(out, checkpoint_every=2, record_samples=True, tensorboard=False, progress=False) as job:
        model = job.wrap(build(context=8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = job.loader(dt.TokenWindows(tokens, block_size=8), batch_size=4, drop_last=True)
        job.resume(model=model, optimizer=opt)
        for x, y in job.steps(loader, max_steps=steps):
            loss = model(x, y)
            job.backward(loss)
            job.log(loss=loss)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
