"""Writes the fixture `run/` (a checkpoint in the storage format of disttrain 1: DCP's
default `.distcp` records and a pickled `.metadata`) and `expected.safetensors` (the
full state it holds), at world size 2 under DDP:

    python -m torch.distributed.run --standalone --nproc-per-node=2 \
        tests/data/checkpoint_v1/make_fixture.py

It was run once, with the code of that format, when the built-in GPT's attention had
one fused `qkv` layer; the tests load the committed files into that model
(`ckpt_common.build(..., fused=True)`).
Rerunning it with a later disttrain writes that version's format instead.
"""

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "workers"))

from ckpt_common import build, full_state, train  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import disttrain as dt  # noqa: E402
from disttrain.builtin import GPTConfig  # noqa: E402
from disttrain.checkpoint import Checkpointer  # noqa: E402

CFG = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1)

if __name__ == "__main__":
    with dt.distributed(seed=0) as info:
        if info.rank == 0:
            shutil.rmtree(HERE / "run", ignore_errors=True)
        dt.barrier()
        state = build("ddp", CFG, fused=True)
        train(state, 2)
        os.chdir(HERE)  # DCP records the folder it wrote: a relative one names no machine
        ck = Checkpointer(Path("run"), keep_last=0)
        ck.save(state)
        ck.close()
        full = full_state(state)
        if info.rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, "expected.safetensors")
