"""Written for the corpus in the shape of pytorch/examples imagenet/main.py (not a copy):
mp.spawn, DDP when distributed and DataParallel otherwise, a rank-guarded checkpoint."""
import datetime
import os
import shutil

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data


def main(args):
    ngpus = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.world_size = ngpus * args.world_size
        mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
    else:
        main_worker(args.gpu, ngpus, args)


def main_worker(gpu, ngpus, args):
    args.gpu = gpu
    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size,
                                rank=args.rank, timeout=datetime.timedelta(minutes=10))
    model = nn.Linear(8, 8)
    if not torch.cuda.is_available():
        print("using CPU, this will be slow")
    elif args.distributed:
        torch.cuda.set_device(args.gpu)
        model.cuda(args.gpu)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    elif args.gpu is not None:
        torch.cuda.set_device(args.gpu)
        model = model.cuda(args.gpu)
    else:
        model = torch.nn.DataParallel(model).cuda()
    optimizer = torch.optim.SGD(model.parameters(), args.lr)
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(args.train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(args.val_dataset, shuffle=False)
    else:
        train_sampler = val_sampler = None
    train_loader = torch.utils.data.DataLoader(args.train_dataset, sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(args.val_dataset, sampler=val_sampler)
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        for images, target in train_loader:
            pass
        for images, target in val_loader:
            pass
        if not args.multiprocessing_distributed or args.rank % ngpus == 0:
            save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(),
                             "optimizer": optimizer.state_dict()}, "checkpoint.pth.tar")


def save_checkpoint(state, filename):
    torch.save(state, filename + ".tmp")
    os.replace(filename + ".tmp", filename)
    shutil.copyfile(filename, "model_best.pth.tar")
