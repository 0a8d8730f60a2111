"""Pitfall/fix pairs for the rules added by issue 26 (behavioural, launch and dt.Job rules), for
tests/launch/test_doctor.py's CASES: (rule id, the script with the pitfall, the same script done
right)."""

from __future__ import annotations

JOB = """import torch
import disttrain as dt
with dt.Job(out_dir="runs/x", accum_steps=4) as job:
    model = job.wrap(torch.nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    loader = job.loader(dataset, batch_size=32)
    job.resume(model=model, optimizer=opt, scheduler=sched)
    for batch in job.steps(loader, max_steps=1000):
        loss = model(batch).mean()
        job.backward(loss)
"""


def new_cases(PRE: str) -> list[tuple[str, str, str]]:
    return [
        ("rank-local-exit",
         PRE + "import math, sys\nfor x in loader:\n    loss = model(x)\n    v = loss.item()\n"
               "    if not math.isfinite(v):\n        sys.exit(1)\n",
         PRE + "import math, sys\nfor x in loader:\n    loss = model(x)\n    dist.all_reduce(loss)\n"
               "    v = loss.item()\n    if not math.isfinite(v):\n        sys.exit(1)\n"),
        ("ema-before-broadcast",
         PRE + "torch.manual_seed(0 + rank)\nmodel = nn.Linear(2, 2).cuda()\nema = ModelEma(model)\n"
               "model = DDP(model, device_ids=[local_rank])\n",
         PRE + "torch.manual_seed(0 + rank)\nmodel = nn.Linear(2, 2).cuda()\n"
               "model = DDP(model, device_ids=[local_rank])\nema = ModelEma(model.module)\n"),
        ("guard-true-on-every-rank",
         "import argparse, torch\np = argparse.ArgumentParser()\np.add_argument('--local_rank', default=0)\n"
         "args = p.parse_args()\nif args.local_rank == 0:\n    torch.save({}, 'c.pt')\n",
         "import argparse, os, torch\np = argparse.ArgumentParser()\np.add_argument('--local_rank', default=0)\n"
         "args = p.parse_args()\nargs.local_rank = int(os.environ['LOCAL_RANK'])\n"
         "if args.local_rank == 0:\n    torch.save({}, 'c.pt')\n"),
        ("full-state-dict-on-every-gpu",
         PRE + "cfg = FullStateDictConfig(rank0_only=True)\n",
         PRE + "cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)\n"),
        ("collective-before-set-device",
         "import os, torch, torch.distributed as dist\ndist.init_process_group('nccl', timeout=t)\n"
         "dist.barrier()\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n",
         "import os, torch, torch.distributed as dist\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
         "dist.init_process_group('nccl', timeout=t)\ndist.barrier()\n"),
        ("job-scheduler-stepped-twice",
         JOB + "        sched.step()\n", JOB),
        ("job-optimizer-before-wrap",
         JOB.replace("    model = job.wrap(torch.nn.Linear(2, 2))\n    opt = torch.optim.AdamW(model.parameters())\n",
                     "    model = torch.nn.Linear(2, 2)\n    opt = torch.optim.AdamW(model.parameters())\n"
                     "    model = job.wrap(model)\n"), JOB),
        ("job-manual-step",
         JOB + "        loss.backward()\n", JOB),
        ("init-rank-is-local-rank",  # cleanrl's ppo_atari_multigpu.py
         "import os, torch.distributed as dist\nlocal_rank = int(os.getenv('LOCAL_RANK', '0'))\n"
         "dist.init_process_group('gloo', rank=local_rank, world_size=int(os.environ['WORLD_SIZE']), timeout=t)\n",
         "import os, torch.distributed as dist\nrank = int(os.environ['RANK'])\n"
         "dist.init_process_group('gloo', rank=rank, world_size=int(os.environ['WORLD_SIZE']), timeout=t)\n"),
        ("shard-by-local-rank",  # DPR's train_dense_encoder.py (round 7)
         PRE + "sampler = DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=local_rank)\n",
         PRE + "sampler = DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=dist.get_rank())\n"),
        ("uneven-batches",  # F5-TTS's trainer.py (round 7)
         "from accelerate import Accelerator\naccelerator = Accelerator()\naccelerator.even_batches = False\n"
         "for batch in loader:\n    accelerator.backward(model(batch))\n",
         "from accelerate import Accelerator\naccelerator = Accelerator()\n"
         "for batch in loader:\n    accelerator.backward(model(batch))\n"),
    ]
