# issue: https://github.com/huggingface/accelerate/issues/3533
# summary: accelerator.backward() already divides the loss by gradient_accumulation_steps; dividing it in the loop too shrinks gradients twice
# family: loss divided twice
import torch
from accelerate import Accelerator

GRAD_ACCUM = 4


def main(model, optimizer, train_dataloader):
    accelerator = Accelerator(gradient_accumulation_steps=GRAD_ACCUM)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    model.train()
    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            # "normalise for accumulation", as a hand-written loop would
            loss = loss / GRAD_ACCUM
            accelerator.backward(loss)  # expect: loss-divided-twice
            optimizer.step()
            optimizer.zero_grad()
