# issue: https://github.com/huggingface/accelerate/issues/226
# summary: accuracy gathered with accelerator.gather() over the MNIST test set uses 10167 samples instead of 10000 on 3 GPUs
# family: padded eval shards gathered
import torch
from accelerate import Accelerator


def test(accelerator: Accelerator, model, test_loader, accuracy):
    model.eval()
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            pred = output.argmax(dim=1, keepdim=True)
            all_preds, all_targets = accelerator.gather((pred, target))  # expect: eval-gather-padded
            accuracy.update(all_preds, all_targets)
    return accuracy.compute()
