"""Single-device training: the script that every other one here is converted from."""

import torch
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model
from torch.utils.data import DataLoader


def main() -> None:
    bench = Bench()
    torch.manual_seed(0)
    data = make_dataset()
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for i, (x, y) in enumerate(loader):
        _, loss = model(x, y)
        (loss / ACCUM_STEPS).backward()
        if (i + 1) % ACCUM_STEPS == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if bench.step(loss):
                break
    print(f"loss {loss.item():.4f}")
    bench.finish()


if __name__ == "__main__":
    main()
