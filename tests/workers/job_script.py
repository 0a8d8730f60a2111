"""A user's plain training script converted with `dt.Job` as the README shows it: a small
transformer classifier on synthetic tokens, AdamW with a LambdaLR warmup-cosine schedule
given to job.resume (Job steps it), an evaluation with an accuracy metric every
--eval-every steps and at the last (tests/faults/test_job_user_path.py).

    job_script.py OUT [--steps N] [--strategy ddp|fsdp] [--workers N] [--eval-every N]
                      [--own-sched] [--batch N] [--record-samples] [--slow-batches S]

Each evaluation appends {"step", "rank", "indices"} lines to OUT/evals.jsonl.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

import disttrain as dt

VOCAB, SEQ, CLASSES = 32, 8, 4


class TokenSet(torch.utils.data.Dataset):
    """Synthetic tokens; the label is the most frequent token's class. `pause`: seconds
    each item takes to load (a slow disk), to keep loader workers busy."""

    def __init__(self, n: int, seed: int, pause: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.y = self.x.mode(dim=1).values % CLASSES
        self.pause = pause

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.pause:
            time.sleep(self.pause)
        return {"tokens": self.x[i], "label": self.y[i], "index": i}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, tokens, label, index=None):
        logits = self.head(self.block(self.emb(tokens)).mean(1))
        return logits, nn.functional.cross_entropy(logits, label)


def main(a):
    out = Path(a.out)
    with dt.Job(out, strategy=a.strategy, checkpoint_every=a.ckpt_every,
                record_samples=a.record_samples) as job:
        model = job.wrap(Classifier())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        warm = max(1, a.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (a.steps - warm)))
        )
        loader = job.loader(TokenSet(512, 0, a.slow_batches), batch_size=a.batch, num_workers=a.workers)

        def metric(model, batch):
            logits, loss = model(**batch)
            with (out / "evals.jsonl").open("a") as f:
                f.write(json.dumps({"step": job.step, "rank": job.info.rank,
                                    "indices": batch["index"].tolist()}) + "\n")
            return {"loss": loss, "accuracy": ((logits.argmax(1) == batch["label"]).sum(), len(logits))}

        job.evaluator(TokenSet(100, 1), batch_size=16, every=a.eval_every, metric=metric)
        job.resume(model=model, optimizer=opt, scheduler=sched)
        for batch in job.steps(loader, max_steps=a.steps):
            _, loss = model(**batch)
            job.backward(loss)
            job.log(loss=loss)
            if a.own_sched:
                sched.step()  # the mistake: a leftover of the script before the conversion
        dt.print_main(f"done at step {job.step}; lr {opt.param_groups[0]['lr']:.3g}; pid {os.getpid()}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--own-sched", action="store_true")
    ap.add_argument("--record-samples", action="store_true")
    ap.add_argument("--slow-batches", type=float, default=0.0)
    main(ap.parse_args())
