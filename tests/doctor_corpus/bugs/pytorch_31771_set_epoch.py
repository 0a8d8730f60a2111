# issue: https://github.com/pytorch/pytorch/issues/31771
# summary: DistributedSampler(shuffle=True) gives the same order every epoch: the loop never calls set_epoch
# family: missing set_epoch
# Rebuilt from the reproduction (torchrun instead of torch.distributed.launch).
import datetime

import torch
from torch.utils.data import DataLoader, Dataset


class RandomDataset(Dataset):
    def __init__(self):
        self.data = torch.rand(22, 1, 32, 32)
        self.name = torch.arange(1, 22)

    def __getitem__(self, idx):
        return self.name[idx], self.data[idx]

    def __len__(self):
        return len(self.data)


torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
dataset = RandomDataset()
sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=True)  # expect: sampler-without-set-epoch
dataloader = DataLoader(dataset, batch_size=5, drop_last=True, sampler=sampler)

for epoch in range(3):
    for i, data in enumerate(dataloader, 0):
        names, _ = data
