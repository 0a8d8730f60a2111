# issue: https://github.com/huggingface/accelerate/issues/350
# summary: accelerator.gather in the evaluation loop returns 24 predictions for 22 samples on 3 devices: the padding of the last batch enters the metric
# family: padded eval shards gathered
import evaluate
import torch
from accelerate import Accelerator


def evaluate_model(accelerator: Accelerator, model, eval_dataloader):
    metric = evaluate.load("glue", "mrpc")
    model.eval()
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits.argmax(dim=-1)
        metric.add_batch(
            predictions=accelerator.gather(predictions),  # expect: eval-gather-padded
            references=accelerator.gather(batch["labels"]),
        )
    return metric.compute()
