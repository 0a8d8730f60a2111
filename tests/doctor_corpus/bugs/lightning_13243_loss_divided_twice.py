# issue: https://github.com/Lightning-AI/pytorch-lightning/issues/13243
# summary: under automatic optimization Lightning divides the training_step loss by accumulate_grad_batches (ClosureResult.from_training_step_output); a module that divides it too gets gradients accumulate_grad_batches times too small
# family: loss divided twice
import lightning as L
import torch
import torch.nn.functional as F


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        return loss / self.trainer.accumulate_grad_batches  # expect: loss-divided-twice

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(accelerator="gpu", devices=4, strategy="ddp", accumulate_grad_batches=4)
