"""Rank script for tests/launch/test_hf_models.py: a Hugging Face GPT-2 (from a config) in the
`HFCausalLM` adapter trains 3 steps under FSDP2 on the ranks and saves a checkpoint
whose stored config names the model (`model.hf`), as `disttrain train` does.
Writes out/rank{r}.json: per-step losses, FSDP units, and (rank 0) out/logits.pt, the
trained model's logits on a fixed input."""

import json
import sys
from pathlib import Path

import torch

import disttrain as dt
from disttrain.checkpoint import Checkpointer, TrainState
from disttrain.train.hf_models import build_hf_model

MODEL = {"hf": "gpt2", "hf_config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 256,
                                     "n_positions": 16, "bos_token_id": 0, "eos_token_id": 1}}
PROBE = torch.arange(2 * 12).view(2, 12) * 7 % 256


def main(out: Path) -> None:
    with dt.distributed(backend="gloo", seed=0) as info:
        torch.manual_seed(0)
        model = dt.wrap(build_hf_model(MODEL), strategy="fsdp")  # the HFCausalLM adapter
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, 256, (8, 13), generator=torch.Generator().manual_seed(1))
        losses = []
        for _step in range(3):
            batch = data[info.rank::info.world_size]
            _, loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(dt.global_mean(loss.item(), 1))
        state = TrainState(model=model, optimizer=opt, config={"model": MODEL})
        state.step = 3
        Checkpointer(out / "ckpt").save(state)
        model.eval()
        with torch.no_grad():
            logits, _ = model(PROBE)
        if info.rank == 0:
            torch.save(logits, out / "logits.pt")
        units = sum(type(m).__name__ == "FSDPGPT2Block" for m in dt.unwrap(model).modules())
        (out / f"rank{info.rank}.json").write_text(json.dumps({"losses": losses, "units": units}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
