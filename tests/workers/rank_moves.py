"""Worker: a process that starts a second process group at another rank of an equal
world, as a fast recovery's generation may after a shrink and a join
(tests/faults/test_fast_recovery.py).

    rank_moves.py OUT

Each rank starts a group (`dt.init` on its own prefix of a file store), shards a small
model with `dt.wrap` (FSDP2) and takes an Adam step; it then shuts the group down and
starts a second one in which ranks 0 and 1 trade places, shards the same model again,
takes a step and saves model and optimizer with DCP. Writes OUT/rank{r}.json (r: the
rank in the second group): the mesh coordinate its parameters and Adam moments report
there, and the DCP save's error ("" when it saved).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import disttrain as dt


def one_place(store: dist.Store, prefix: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A group on `prefix` of `store` at this process's RANK; the model sharded and stepped once."""
    dt.init(backend="gloo", device="cpu", store=dist.PrefixStore(prefix, store))
    torch.manual_seed(0)
    model = dt.wrap(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4)),
                    strategy="fsdp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def main() -> None:
    out = Path(sys.argv[1])
    store = dist.FileStore(str(out / "store"), 2)
    model, optimizer = one_place(store, "first")
    del model, optimizer
    dt.shutdown()
    os.environ["RANK"] = str(1 - int(os.environ["RANK"]))  # the ranks trade places
    model, optimizer = one_place(store, "second")
    rank = dist.get_rank()
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    error = ""
    try:
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(out / "ckpt"))
    except Exception as e:  # noqa: BLE001  (the worker reports it)
        error = f"{type(e).__name__}: {str(e)[:300]}"
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank,
        "parameters": sorted({p.device_mesh.get_coordinate()[0] for p in model.parameters()}),
        "moments": sorted({m.device_mesh.get_coordinate()[0] for m in moments}),
        "save_error": error,
    }))
    dt.shutdown()


if __name__ == "__main__":
    main()
