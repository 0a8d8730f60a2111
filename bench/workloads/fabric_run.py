"""plain.py converted to Lightning Fabric (`Fabric.setup`, `no_backward_sync`)."""

import torch
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model
from lightning.fabric import Fabric
from torch.utils.data import DataLoader


def main() -> None:
    bench = Bench()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    data = make_dataset()
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for i, (x, y) in enumerate(loader):
        sync = (i + 1) % ACCUM_STEPS == 0
        with fabric.no_backward_sync(model, enabled=not sync):
            _, loss = model(x, y)
            fabric.backward(loss / ACCUM_STEPS)
        if sync:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if bench.step(loss):
                break
    fabric.print(f"loss {fabric.all_reduce(loss.detach(), reduce_op='mean').item():.4f}")
    bench.finish()


if __name__ == "__main__":
    main()
