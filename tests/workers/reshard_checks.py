"""Worker: FSDP2 shards of a world of 4, packed as buddy copies, rebuilt for a world of 2
(`elastic.buddy_reshard`), on gloo ranks under torchrun (tests/faults/test_fast_recovery.py).

    reshard_checks.py OUT

Every rank trains a small model with uneven row counts (so FSDP's pieces differ in size
and one rank's piece of a 3-row weight is empty) for two Adam steps at world 4, packs its
`live_state` as the buddy copy does, and the packs are gathered. Ranks 0 and 1 then build
the same model sharded over a mesh of 2 and load the rebuilt state. Each writes
OUT/rank{r}.json: whether every parameter and every Adam moment, made whole again,
equals the world-4 original bit for bit.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from disttrain.elastic.buddy_copy import live_state, load_live_state, pack, template_of, unpack
from disttrain.elastic.buddy_reshard import _rebuild


def model_on(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def whole(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, gathered whole (a collective of the model's mesh)."""
    out = {f"p.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{i}"] = state[name].full_tensor()
    return out


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = model_on(init_device_mesh("cpu", (4,)))
    for step in range(2):
        torch.manual_seed(100 + step + rank)
        model(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    before = whole(model, optimizer)
    state = SimpleNamespace(model=model, optimizer=optimizer, scheduler=None, sampler=None, scaler=None, step=2,
                            epoch=0)
    mine = pack(live_state(state))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]))
    top = int(max(s.item() for s in sizes))
    padded = [torch.zeros(top, dtype=torch.uint8) for _ in range(4)]
    dist.all_gather(padded, torch.cat([mine, torch.zeros(top - mine.numel(), dtype=torch.uint8)]))
    packs = [p[: int(s.item())] for p, s in zip(padded, sizes, strict=True)]
    result = {"rank": rank}
    pair = DeviceMesh("cpu", [0, 1])  # made on every rank: its group is a collective of all
    if rank < 2:
        small, small_opt = model_on(pair)
        new = SimpleNamespace(model=small, optimizer=small_opt, scheduler=None, sampler=None, scaler=None, step=0,
                              epoch=0)
        trees = [unpack(p, None, local=True) for p in packs]
        load_live_state(new, _rebuild(trees, template_of(new)))
        after = whole(small, small_opt)
        result["same"] = after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        result["step"] = new.step
        result["uneven"] = [tuple(v.to_local().shape) for v in small.state_dict().values()]
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
