"""Worker: two parts of an in-memory restore under FSDP, on 2 gloo ranks under torchrun
(tests/faults/test_fast_recovery.py).

    restore_parts.py OUT

1. The load: each rank trains a small FSDP2 model with uneven row counts for two Adam
   steps, packs its `live_state` as the buddy copy does, changes its weights, and loads
   the pack back (`load_live_state`). It reports whether every parameter and moment,
   made whole, equals the packed one bit for bit, and whether each parameter kept its
   storage (the shards FSDP trains are the ones written).
2. The salvage after a failure: a `BuddyCopy` exchanges the packs of steps 1 and 2;
   the exchange of step 2 is left in flight, as a peer's death leaves it, and
   `salvage` keeps what arrived. It reports the steps of the source's packs it holds.

Writes OUT/rank{r}.json.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from disttrain.elastic.buddy_copy import BuddyCopy, live_state, load_live_state, pack, template_of, unpack


def trained_state(mesh) -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(2):
        torch.manual_seed(100 + step + dist.get_rank())
        model(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=None, sampler=None, scaler=None, step=2, epoch=0)


def whole(state) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.full_tensor() for k, v in state.model.state_dict().items()}
    for i, entry in state.optimizer.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{i}"] = entry[name].full_tensor()
    return out


def load_back(state) -> dict:
    packed = pack(live_state(state))
    before = whole(state)
    storages = [p.to_local().untyped_storage().data_ptr() for p in state.model.parameters()]
    with torch.no_grad():
        for p in state.model.parameters():
            p.to_local().add_(1.0)
    load_live_state(state, unpack(packed, template_of(state)))
    after = whole(state)
    return {
        "same": after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before),
        "kept_storage": storages == [p.to_local().untyped_storage().data_ptr() for p in state.model.parameters()],
    }


def salvaged_steps(state) -> list[int]:
    copy = BuddyCopy()
    copy.attach(dist.new_group(backend="gloo"))
    copy.start(1, state)
    copy.finish()
    copy.start(2, state, force=True)  # in flight when the generation fails
    dist.barrier()  # both packs were sent: the receive completes within the salvage's wait
    copy.salvage()
    return sorted(copy.theirs)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = trained_state(init_device_mesh("cpu", (2,)))
    result = {"rank": rank, **load_back(state), "theirs": salvaged_steps(state)}
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
