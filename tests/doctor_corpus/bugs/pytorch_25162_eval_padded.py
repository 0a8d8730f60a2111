# issue: https://github.com/pytorch/pytorch/issues/25162
# summary: DistributedSampler pads the validation set with repeated samples, so distributed validation accuracy (all-reduced counts) is wrong
# family: padded eval shards gathered
import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def validate(model, val_dataset, device):
    val_sampler = DistributedSampler(val_dataset, shuffle=False)  # expect: eval-gather-padded
    val_loader = DataLoader(val_dataset, batch_size=64, sampler=val_sampler)
    correct = torch.zeros(2, device=device)
    with torch.no_grad():
        for images, target in val_loader:
            pred = model(images.to(device)).argmax(dim=1)
            correct[0] += (pred == target.to(device)).sum()
            correct[1] += target.numel()
    dist.all_reduce(correct)
    return (correct[0] / correct[1]).item()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
