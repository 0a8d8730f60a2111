# issue: https://github.com/Lightning-AI/pytorch-lightning/issues/5325
# summary: resuming from the last checkpoint does not continue the same run: the random state is not part of the checkpoint, so shuffles and dropout restart from the seed
# family: checkpoint without RNG/data state
import datetime
import os

import torch
import torch.distributed as dist


def fit(model, optimizer, scheduler, loader, epochs, path="last.ckpt"):
    first = 0
    if os.path.exists(path):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_states"])
        scheduler.load_state_dict(ckpt["lr_schedulers"])
        first = ckpt["epoch"] + 1
    for epoch in range(first, epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        scheduler.step()
        if dist.get_rank() == 0:
            torch.save({"state_dict": model.module.state_dict(),  # expect: checkpoint-missing-state
                        "optimizer_states": optimizer.state_dict(),
                        "lr_schedulers": scheduler.state_dict(), "epoch": epoch}, path + ".tmp")
            os.replace(path + ".tmp", path)


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
