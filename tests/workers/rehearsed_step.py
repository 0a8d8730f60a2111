"""Worker: a spare's rehearsal of its first sharded step (`train.spare_rehearsal`), then
the real step, on gloo ranks under torchrun (tests/unit/test_spare_rehearsal.py).

    rehearsed_step.py OUT same|swapped

Each rank rehearses the built-in GPT's first step under FSDP on a fake group of 2, as
its own rank ("same") or as the other one ("swapped": a spare promoted elsewhere than
it guessed), then starts the real group at its rank, wraps the same model, takes one
clipped AdamW step on the same batch and saves model and optimizer with DCP. Writes
OUT/rank{r}.json: the rehearsal's seconds, whether it left a group behind, the mesh
coordinate of its parameters and Adam moments, the save's error ("" when it saved) and
the stepped weights, whole.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import disttrain as dt
from disttrain.builtin import GPT
from disttrain.config import Config
from disttrain.config.schema import ModelConfig, ParallelConfig
from disttrain.parallel.optimizers import build_optimizer
from disttrain.train.accumulation import clip_grad_norm
from disttrain.train.spare_rehearsal import rehearse


def main() -> None:
    out, how = Path(sys.argv[1]), sys.argv[2]
    shape = ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
    cfg = Config(model=shape, parallel=ParallelConfig(strategy="fsdp"))
    rank = int(os.environ["RANK"])
    took = rehearse(cfg, lambda: GPT(cfg.model), rank if how == "same" else 1 - rank, 2)
    left = dist.is_initialized()
    dt.init(backend="gloo", device="cpu", store=dist.FileStore(str(out / "store"), 2))
    torch.manual_seed(0)
    model = dt.wrap(GPT(cfg.model), cfg.parallel)
    optimizer = build_optimizer(model, cfg)
    idx = torch.arange(32).reshape(2, 16) % 256
    model(idx, idx)[1].backward()
    clip_grad_norm(model, 1.0)
    optimizer.step()
    error = ""
    try:
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(out / "ckpt"))
    except Exception as e:  # noqa: BLE001  (the worker reports it)
        error = f"{type(e).__name__}: {str(e)[:300]}"
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    weights = {k: v.full_tensor().flatten().tolist() for k, v in model.state_dict().items()}
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rehearsed_s": took,
        "left_a_group": left,
        "parameters": sorted({p.device_mesh.get_coordinate()[0] for p in model.parameters()}),
        "moments": sorted({m.device_mesh.get_coordinate()[0] for m in moments}),
        "save_error": error,
        "weights": weights,
    }))
    dt.shutdown()


if __name__ == "__main__":
    main()
