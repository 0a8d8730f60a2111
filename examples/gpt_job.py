"""examples/gpt_torchrun.py's GPT training moved to `dt.Job`: the same model, data,
optimizer, schedule, accumulation, clipping and evaluation, with the process group,
DDP, sampling, checkpoints and resume handed to the job. Each disttrain name it adds
(`dt.Job` and its methods, `dt.TokenWindows`, `dt.print_main`) is in the API reference;
the model is the one the plain script trains.

    python examples/gpt_job.py --make-data                                # data/stdlib/{train,val}.bin
    disttrain run --nproc 2 --max-restarts 3 examples/gpt_job.py          # killed: it resumes

The change is 123 changed code lines (16 added, 107 removed; comments, blank lines and
indentation not counted), as `python -m bench.code_diff examples/gpt_torchrun.py
examples/gpt_job.py --diff` counts and shows them. What the lines buy: a kill -9 or a SIGTERM resumes
from the newest valid checkpoint with bit-identical weights and every window of the
epoch once (the plain script restarts the epoch and writes its checkpoint in place),
one evaluation split across the ranks, the dropout seeded per step, metrics in
out/metrics.jsonl, and the final weights in out/model.pt.
"""

import argparse
import math
import sysconfig
from pathlib import Path

import numpy as np
import torch

import disttrain as dt
from disttrain.builtin import GPT, GPTConfig
from disttrain.config import CheckpointConfig, Config, OptimConfig, TrainConfig


def make_data(folder: str, max_bytes: int) -> None:
    """train.bin and val.bin: the stdlib's .py files as byte tokens, every tenth file held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    size = 0
    for i, path in enumerate(files):
        if size >= max_bytes:
            break
        text = path.read_bytes()
        parts["val" if i % 10 == 9 else "train"].append(text)
        size += len(text)
    Path(folder).mkdir(parents=True, exist_ok=True)
    for split, texts in parts.items():
        np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.uint16).tofile(f"{folder}/{split}.bin")
        print(f"{folder}/{split}.bin: {sum(map(len, texts)):,} tokens")


def lr_lambda(args):
    """The factor on the base learning rate: linear warmup, then a cosine down to 10%."""
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def main(args) -> None:
    # The process group (torchrun's environment, or none under plain python), this rank's
    # device, the seed on every rank, SIGTERM, checkpoints and resume: the job's.
    # The run's settings are the TOML's own sections; the clip is the plain script's 1.0.
    config = Config(train=TrainConfig(accum_steps=args.accum, seed=args.seed, log_every=args.log_every),
                    optim=OptimConfig(grad_clip=1.0), checkpoint=CheckpointConfig(every=args.ckpt_every))
    with dt.Job(args.out, config, run=dt.RunOptions(tokens_per_sample=args.block_size)) as job:
        config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        model = job.wrap(GPT(config))  # DDP, on this rank's device
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))

        train_set = dt.TokenWindows(f"{args.data}/train.bin", args.block_size)
        val_set = dt.TokenWindows(f"{args.data}/val.bin", args.block_size)
        loader = job.loader(train_set, batch_size=args.batch_size, drop_last=True)  # resumable mid-epoch
        job.evaluator(val_set, batch_size=args.batch_size, every=args.eval_every, max_batches=args.eval_batches)
        job.resume(model=model, optimizer=optimizer, scheduler=scheduler)  # newest valid checkpoint, if any

        for x, y in job.steps(loader, max_steps=args.steps):
            _, loss = model(x, y)
            job.backward(loss)  # no_sync until the window's last micro-batch, then clip and step
            job.log(loss=loss)
        dt.print_main(f"done at step {job.step}; weights in {args.out}/model.pt")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a small GPT on a token file")
    ap.add_argument("--make-data", action="store_true", help="write DATA/{train,val}.bin and exit")
    ap.add_argument("--data-bytes", type=int, default=4_000_000, help="--make-data's token budget")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--out", default="runs/gpt_job")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=100)
    a = ap.parse_args()
    if a.make_data:
        make_data(a.data, a.data_bytes)
    else:
        main(a)
