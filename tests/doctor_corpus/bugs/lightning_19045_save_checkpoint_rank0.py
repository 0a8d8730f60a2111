# issue: https://github.com/Lightning-AI/pytorch-lightning/issues/19045
# summary: DDP training hangs in Trainer.save_checkpoint, which ends in strategy.barrier("Trainer.save_checkpoint"): a collective, so a save_checkpoint that only rank 0 reaches (here under is_global_zero) waits forever
# family: collective under a rank guard
import lightning as L


class SaveEveryN(L.Callback):
    def __init__(self, every_n_steps, dirpath):
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every_n_steps == 0 and trainer.is_global_zero:
            trainer.save_checkpoint(f"{self.dirpath}/step-{trainer.global_step}.ckpt")  # expect: collective-under-rank-guard


trainer = L.Trainer(accelerator="gpu", devices=4, strategy="ddp", callbacks=[SaveEveryN(500, "ckpts")])
