# issue: https://github.com/huggingface/transformers/issues/15801
# summary: run_glue_no_trainer.py stepped the optimizer when `step % gradient_accumulation_steps == 0` with step from enumerate(): an update after the first micro-batch alone
# family: accumulation window off by one
import argparse

from accelerate import Accelerator


def train(args: argparse.Namespace, model, optimizer, lr_scheduler, train_dataloader):
    accelerator = Accelerator()
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            loss = model(**batch).loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            # the window test counts micro-batches from 0, so step 0 already closes a window
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()  # expect: accumulation-off-by-one
                lr_scheduler.step()
                optimizer.zero_grad()
