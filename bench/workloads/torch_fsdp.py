"""plain.py converted by hand to bare PyTorch FSDP2 (`fully_shard` per block, then the root)."""

import torch
import torch.distributed as dist
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    bench = Bench()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = make_dataset()
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.get_submodule("blocks").children():
        fully_shard(block, mesh=mesh)
    sharded = fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for i, (x, y) in enumerate(loader):
        sync = (i + 1) % ACCUM_STEPS == 0
        sharded.set_requires_gradient_sync(sync)
        _, loss = model(x, y)
        (loss / ACCUM_STEPS).backward()
        if sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if bench.step(loss):
                break
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if dist.get_rank() == 0:
        print(f"loss {mean.item() / dist.get_world_size():.4f}")
    bench.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
