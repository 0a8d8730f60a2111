# issue: https://github.com/Lightning-AI/pytorch-lightning/issues/2398
# summary: metrics synced across DDP processes include the extra samples DistributedSampler adds to make the evaluation split evenly divisible
# family: padded eval shards gathered
import datetime
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def test_epoch(model, test_dataset, device):
    test_sampler = DistributedSampler(test_dataset)  # expect: eval-gather-padded
    loader = DataLoader(test_dataset, batch_size=16, sampler=test_sampler)
    scores = []
    for x, y in loader:
        scores.append((model(x.to(device)).argmax(1) == y.to(device)).float())
    local = torch.cat(scores)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.cat(gathered).mean()


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
