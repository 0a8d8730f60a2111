# issue: https://github.com/pytorch/pytorch/issues/22584
# summary: the validation result changes with the number of processes because DistributedSampler adds repeated samples to make the split even
# family: padded eval shards gathered
import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def validation_set_eval(model, valid_set, device):
    loader = DataLoader(valid_set, batch_size=32,
                        sampler=DistributedSampler(valid_set, shuffle=False))  # expect: eval-gather-padded
    preds = []
    with torch.no_grad():
        for x, _ in loader:
            preds.append(model(x.to(device)).cpu())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, torch.cat(preds))
    return torch.cat(everyone)


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
