# issue: https://github.com/Lightning-AI/pytorch-lightning/issues/4761
# summary: a model trained with strategy ddp and saved with torch.save after fit could not be loaded (file not found: archive/data/...): every DDP process runs the code after fit, so each rank writes the same file
# family: save on every rank
import lightning as L
import torch


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(train_loader):
    model = Model()
    trainer = L.Trainer(accelerator="gpu", devices=2, strategy="ddp", max_epochs=3)
    trainer.fit(model, train_loader)
    model.trainer = None  # detach the trainer and logger before pickling
    torch.save(model, "model.pt")  # expect: unguarded-save
