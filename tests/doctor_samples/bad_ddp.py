"""A DDP script with the classic pitfalls; test_doctor.py checks each finding.

Never run: it exists to be read by `disttrain doctor`.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

os.environ["MASTER_PORT"] = "12355"
ACCUM_STEPS = 8


def train(dataset):
    dist.init_process_group("nccl")
    model = nn.Linear(16, 1).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model = DDP(model, find_unused_parameters=True)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, sampler=sampler, batch_size=32)
    for epoch in range(5):
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x.cuda()), y.cuda()) / ACCUM_STEPS
            loss = loss / ACCUM_STEPS
            loss.backward()
            if (step + 1) % ACCUM_STEPS == 0:
                optimizer.step()
                optimizer.zero_grad()
        print(f"epoch {epoch} loss {loss.item()}")
        torch.save(model.state_dict(), "model.pt")
    state = torch.load("model.pt")
    return state
