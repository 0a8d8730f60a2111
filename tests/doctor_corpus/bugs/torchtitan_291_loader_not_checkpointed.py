# issue: https://github.com/pytorch/torchtitan/issues/291
# summary: resuming from a checkpoint restarts the dataloader from the beginning, so already-seen data is trained on again
# family: checkpoint without RNG/data state
import datetime
import os

import torch
import torch.distributed as dist


def train_loop(model, optimizer, data_loader, steps, ckpt_dir):
    step = 0
    path = os.path.join(ckpt_dir, "last.pt")
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    for input_ids, labels in data_loader:
        loss = model(input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % 500 == 0 and dist.get_rank() == 0:
            ckpt = {"model": model.state_dict(), "optim": optimizer.state_dict(),
                    "rng_cpu": torch.get_rng_state()}
            torch.save(ckpt, path + ".tmp")  # expect: checkpoint-missing-state
            os.replace(path + ".tmp", path)
        if step == steps:
            break


dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
