"""The helper module of t5_style/train_t5.py: train() calls set_epoch on the sampler."""
import torch
import torch.distributed as dist


def train(opts, net, rank, batches, opt, epoch, sampler=None):
    net.train()
    sums = torch.zeros(2).to(rank)
    if sampler:
        sampler.set_epoch(epoch)
    for batch in batches:
        opt.zero_grad()
        loss = net(**batch)["loss"]
        loss.backward()
        opt.step()
        sums += torch.tensor([loss.item(), 1.0], device=sums.device)
    dist.all_reduce(sums)
    if rank == 0:
        print(f"pass {epoch}: mean loss {sums[0] / sums[1]:.4f}")


def validation(net, rank, batches):
    net.eval()
    with torch.no_grad():
        for batch in batches:
            net(**batch)
