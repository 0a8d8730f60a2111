"""A single-device training loop converted to multi-process DDP with disttrain.

The lines marked `# dt` are the whole change from the plain script; delete them
(and use `model`/`optimizer` directly) and it is the single-device loop again.

    python examples/plain_to_ddp.py                   # one process
    disttrain run --nproc 2 examples/plain_to_ddp.py  # two processes, gloo on CPU

Every rank sees a disjoint shard of the data, gradients are all-reduced once per
optimizer step, the logged loss is the global mean, and only rank 0 prints and saves.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import disttrain as dt  # dt
from disttrain.builtin import MLP, MLPConfig


def make_data(n: int = 2048) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 4, generator=g))


def main() -> None:
    with dt.distributed(seed=0) as info:  # dt: process group, device, seeds; torn down on exit
        data = make_data()
        sampler = dt.DistributedSampler(data, seed=0)  # dt: disjoint shard; epoch advances itself
        loader = DataLoader(data, batch_size=32, sampler=sampler)
        model = dt.wrap(MLP(MLPConfig()))  # dt: DDP (a plain module in a world of 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after wrap
        acc = dt.Accumulator(model, optimizer, accum_steps=2)  # dt: no_sync on non-boundary steps
        for epoch in range(5):
            loss_mean = dt.MeanTracker()  # dt: global (sum, count) mean
            for x, y in loader:
                with acc.micro_step():
                    _, loss = model(x.to(info.device), y.to(info.device))
                    acc.backward(loss)
                loss_mean.update(loss.detach(), len(x))
            dt.print_main(f"epoch {epoch}: loss {loss_mean.compute():.4f}")  # dt: rank 0 only
        dt.save_model(model, "runs/plain_to_ddp/model.pt")  # dt: rank 0, atomic, no `module.`


if __name__ == "__main__":
    main()
