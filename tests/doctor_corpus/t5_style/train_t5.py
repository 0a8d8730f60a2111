"""Written for the corpus in the shape of an FSDP fine-tuning script (pytorch/examples'
T5 example; not a copy): samplers handed to train()/validation() that live in
utils/train_utils.py."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, DistributedSampler

from utils.train_utils import train, validation


def run(opts, net, fit_set, val_set):
    local_rank, rank = int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    fit_sampler = DistributedSampler(fit_set, rank=rank, num_replicas=world, shuffle=True)
    val_sampler = DistributedSampler(val_set, rank=rank, num_replicas=world)
    fit_opts = {"batch_size": opts.batch, "sampler": fit_sampler}
    val_opts = {"batch_size": opts.val_batch, "sampler": val_sampler}
    fit_loader = DataLoader(fit_set, **fit_opts)
    val_loader = DataLoader(val_set, **val_opts)
    net = FSDP(net.to(local_rank), device_id=torch.cuda.current_device())
    opt = torch.optim.AdamW(net.parameters(), lr=opts.lr)
    for epoch in range(opts.passes):
        train(opts, net, rank, fit_loader, opt, epoch, sampler=fit_sampler)
        validation(net, rank, val_loader)
    dist.barrier()
    dist.destroy_process_group()
