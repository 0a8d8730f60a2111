"""Written for the corpus in the shape of an ImageNet training script (not a copy): mp.spawn,
DDP when distributed and DataParallel otherwise, a rank-guarded checkpoint."""
import datetime
import os
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data


def main(opts):
    per_node = torch.cuda.device_count()
    if opts.spawn:
        opts.world_size = per_node * opts.nodes
        mp.spawn(worker, nprocs=per_node, args=(per_node, opts))
    else:
        worker(opts.gpu, per_node, opts)


def worker(index, per_node, opts):
    opts.gpu = index
    if opts.distributed:
        if opts.url == "env://" and opts.rank < 0:
            opts.rank = int(os.environ["RANK"])
        dist.init_process_group("nccl", init_method=opts.url, world_size=opts.world_size,
                                rank=opts.rank, timeout=datetime.timedelta(minutes=10))
    net = nn.Linear(8, 8)
    if not torch.cuda.is_available():
        print("no GPU here: the CPU will be slow")
    elif opts.distributed:
        torch.cuda.set_device(opts.gpu)
        net.cuda(opts.gpu)
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[opts.gpu])
    elif opts.gpu is not None:
        torch.cuda.set_device(opts.gpu)
        net = net.cuda(opts.gpu)
    else:
        net = torch.nn.DataParallel(net).cuda()
    opt = torch.optim.SGD(net.parameters(), opts.lr)
    if opts.distributed:
        fit_sampler = torch.utils.data.distributed.DistributedSampler(opts.fit_set)
        val_sampler = torch.utils.data.distributed.DistributedSampler(opts.val_set, shuffle=False)
    else:
        fit_sampler = val_sampler = None
    fit_loader = torch.utils.data.DataLoader(opts.fit_set, sampler=fit_sampler)
    val_loader = torch.utils.data.DataLoader(opts.val_set, sampler=val_sampler)
    for epoch in range(opts.passes):
        if opts.distributed:
            fit_sampler.set_epoch(epoch)
        for inputs, labels in fit_loader:
            pass
        for inputs, labels in val_loader:
            pass
        if not opts.spawn or opts.rank % per_node == 0:
            store({"pass": epoch + 1, "net": net.state_dict(),
                   "opt": opt.state_dict()}, "state.pt")


def store(state, name):
    torch.save(state, name + ".tmp")
    os.replace(name + ".tmp", name)
    shutil.copyfile(name, "best.pt")
