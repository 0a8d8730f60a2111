"""The helper module of t5_style/train_t5.py: train() calls set_epoch on the sampler."""
import torch
import torch.distributed as dist


def train(args, model, rank, world_size, train_loader, optimizer, epoch, sampler=None):
    model.train()
    fsdp_loss = torch.zeros(2).to(rank)
    if sampler:
        sampler.set_epoch(epoch)
    for batch in train_loader:
        optimizer.zero_grad()
        loss = model(**batch)["loss"]
        loss.backward()
        optimizer.step()
        fsdp_loss[0] += loss.item()
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch}, Loss: {fsdp_loss[0] / fsdp_loss[1]:.4f}")


def validation(model, rank, world_size, val_loader):
    model.eval()
    with torch.no_grad():
        for batch in val_loader:
            model(**batch)
