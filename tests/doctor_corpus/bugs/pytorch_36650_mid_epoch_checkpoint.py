# issue: https://github.com/pytorch/pytorch/issues/36650
# summary: a checkpoint taken mid-epoch holds model and optimizer but not the sampler/loader position, so a restart cannot continue at the batch where training stopped
# family: checkpoint without RNG/data state
import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def train(model, optimizer, dataset, epochs, ckpt="ckpt.pt"):
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"]
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if i % 1000 == 0 and dist.get_rank() == 0:
                torch.save({"model": model.module.state_dict(),  # expect: checkpoint-missing-state
                            "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "rng": torch.get_rng_state()}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
