"""train_spec's job written by hand in bare PyTorch: the baseline of the product A/B.

What `disttrain train` does for the same config, as a careful user would write it:
DDP (gradient buckets as views), DistributedSampler, AdamW with decay on matrices only,
linear warmup then cosine, global-norm clipping, the mean loss all-reduced every
LOG_EVERY steps, an evaluation (the first eval_batches x batch x world held-out windows,
sharded by rank, one all-reduce) and a DCP checkpoint of model and optimizer every
EVERY steps, keeping the newest keep_last. Without disttrain's guard, sample audit,
preemption vote, manifest and resume bookkeeping: those are what the A/B measures.
BENCH_VOTE=1 adds disttrain's preemption vote (`PreemptionHandler.should_stop`: an
all-reduce of a stop flag every few steps, read a step later) where the trainer calls it.
The clock is train_spec's: from the log line of step LOG_EVERY to the last one.
"""

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from train_spec import LOG_EVERY, clocks, config, result

from disttrain.builtin.corpus import ChunkDataset, load_stdlib_corpus
from disttrain.builtin.gpt import GPT, GPTConfig
from disttrain.elastic.preemption import PreemptionHandler


def lr_factor(step: int, total: int) -> float:
    warmup = min(max(1, round(0.05 * total)), 2000)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, heldout, batch_size: int, batches: int, rank: int, world: int) -> float:
    model.eval()
    n = min(len(heldout), batches * batch_size * world)
    mine = list(range(rank, n, world))
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(mine), batch_size):
        x, y = (torch.stack(t) for t in zip(*(heldout[i] for i in mine[start : start + batch_size]), strict=False))
        _, loss = model(x, y)
        total += torch.tensor([float(loss.detach()) * y.numel(), y.numel()], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def main() -> None:
    cfg = config()
    m, d, o, t, c = cfg["model"], cfg["data"], cfg["optim"], cfg["train"], cfg["checkpoint"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(t.get("seed", 1337))
    corpus = load_stdlib_corpus(d["max_bytes"], d["heldout_fraction"])
    train_set = ChunkDataset(corpus.train, m["block_size"])
    heldout = ChunkDataset(corpus.heldout, m["block_size"])
    model = DDP(GPT(GPTConfig(**m)), gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o["lr"],
        betas=(0.9, 0.95),
    )
    steps = t["steps"]
    every = c["every"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps))
    sampler: DistributedSampler[int] = DistributedSampler(train_set, seed=t.get("seed", 1337))
    loader = DataLoader(train_set, batch_size=t["batch_size"], sampler=sampler, drop_last=True)
    preempt = PreemptionHandler().install() if os.environ.get("BENCH_VOTE") == "1" else None
    out = Path(t["out_dir"])
    evaluate(model, heldout, t["batch_size"], t["eval_batches"], rank, world)
    step, epoch, log_times, saved = 0, 0, {}, []
    loss_sum = torch.zeros(2, dtype=torch.float64)
    while step < steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += torch.tensor([float(loss.detach()) * y.numel(), y.numel()], dtype=torch.float64)
            if step % LOG_EVERY == 0 or step == steps:
                dist.all_reduce(loss_sum)
                log_times[step] = clocks()
                loss_sum.zero_()
                if t["eval_every"] and step % t["eval_every"] == 0 and step < steps:
                    evaluate(model, heldout, t["batch_size"], t["eval_batches"], rank, world)
            if preempt is not None:
                preempt.should_stop()  # no signal is sent in the benchmark: only its cost
            if every and step % every == 0 and step < steps:
                msd, osd = get_state_dict(model, optimizer)
                path = out / f"step_{step}"
                dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=str(path))
                saved.append(path)
                if rank == 0 and len(saved) > c["keep_last"]:
                    shutil.rmtree(saved.pop(0), ignore_errors=True)
            if step >= steps:
                break
    measured = result(rank, world, log_times, t["batch_size"] * m["block_size"])
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()
    # Freeing the DDP model after this destroys torch 2.13's gloo group, whose destructor
    # joins a worker thread that waits for the GIL the destructor holds (py-spy: a hang,
    # or an abort at interpreter exit); runtime.shutdown guards disttrain's side of it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
