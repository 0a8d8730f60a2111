# issue: https://github.com/pytorch/pytorch/issues/31232
# summary: shuffle=True is the default of DistributedSampler, yet each GPU loads the same data every epoch until set_epoch is called
# family: missing set_epoch
import datetime
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.distributed.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=5))
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)

data = TensorDataset(torch.randn(16, 5), torch.randn(16, 2))
loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data))  # expect: sampler-without-set-epoch
model = nn.parallel.DistributedDataParallel(nn.Linear(5, 2).to(device), device_ids=[local_rank])

for epoch in range(2):
    for x, y in loader:
        out = model(x.to(device))
