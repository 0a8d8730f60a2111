"""plain.py converted to Hugging Face Accelerate (`Accelerator.prepare`, `accumulate`)."""

import torch
from accelerate import Accelerator
from harness import ACCUM_STEPS, BATCH_SIZE, Bench, make_dataset, make_model
from torch.utils.data import DataLoader


def main() -> None:
    bench = Bench()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM_STEPS)
    torch.manual_seed(0)
    data = make_dataset()
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            _, loss = model(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if accelerator.sync_gradients and bench.step(loss):
            break
    accelerator.print(f"loss {accelerator.reduce(loss.detach(), 'mean').item():.4f}")
    bench.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
