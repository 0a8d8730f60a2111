"""Worker for tests/launch/test_plan.py: measure the bytes each rank owns after one step.

Launched by `python -m torch.distributed.run --standalone --nproc-per-node N measure.py OUT.json
HF_CONFIG.json GPT_SPEC KINDS` (KINDS: 'gpt,hf', or 'gpt' where transformers is missing).
For each (model, strategy) case it builds the model, wraps it the way disttrain does
(DDP / DDP + ZeroRedundancyOptimizer / fully_shard per block then root; for our GPT on an
even world also tp 2 x dp world/2, `split_by_hand`), runs one forward +
backward + AdamW step on random bytes, and counts the storage this rank holds for
parameters, gradients and optimizer state. Rank 0 gathers every rank's numbers and writes
JSON.

Bytes are counted per unique storage: DDP gradients that are views into its buckets
(gradient_as_bucket_view=True) and FSDP2 gradients that are views into one reduce-scatter
output are counted once, and FSDP2 shards include their padding (the storage behind
`DTensor.to_local()`), since that is what the allocator actually holds.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def storage_bytes(tensors) -> int:
    """Sum of the distinct storages behind `tensors` (DTensors are counted by their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optim_tensors(opt):
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                yield v


def build(kind: str, hf_config: str, gpt_spec: str) -> tuple[nn.Module, list[nn.Module], int, int]:
    """(model, blocks, vocab, block_size). Same seed on every rank, like a real run."""
    torch.manual_seed(0)
    if kind == "gpt":
        from disttrain.builtin import GPT, GPTConfig

        kw = dict(kv.split("=") for kv in gpt_spec.split(","))
        cfg = GPTConfig(**{k: int(v) for k, v in kw.items()})
        model = GPT(cfg)
        return model, list(model.blocks), cfg.vocab_size, cfg.block_size
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(hf_config)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model, list(model.transformer.h), cfg.vocab_size, cfg.n_positions


def loss_of(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(x, x)[1]
    return model(input_ids=x, labels=x).loss


def split_by_hand(model: nn.Module, blocks: list[nn.Module]):
    """tp 2 x dp world/2 the way torch's 2D examples write it: the model's own plan
    (the built-in GPT's `tp_plan`) with `parallelize_module` over a ('dp', 'tp') mesh,
    then `fully_shard` per block and the root over 'dp'. Returns the dp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for i in range(len(blocks)):
        for pattern, style in model.tp_plan.items():
            plan[pattern.replace("*", str(i))] = styles[style]()
    parallelize_module(model, mesh["tp"], plan)
    return mesh["dp"]


def run_case(kind: str, strategy: str, hf_config: str, gpt_spec: str) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, blocks, vocab, block_size = build(kind, hf_config, gpt_spec)
    if strategy in ("fsdp_full", "tp2"):
        from torch.distributed.fsdp import fully_shard

        mesh = split_by_hand(model, blocks) if strategy == "tp2" else None
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        local_opt = opt
    else:
        wrapped = DDP(model, gradient_as_bucket_view=True)
        if strategy == "zero1":
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-3)
            local_opt = opt.optim  # this rank's shard of the optimizer
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            local_opt = opt
    g = torch.Generator().manual_seed(dist.get_rank() // (2 if strategy == "tp2" else 1))  # a TP group: one batch
    x = torch.randint(0, vocab, (2, min(32, block_size)), generator=g)
    loss_of(kind, wrapped, x).backward()
    opt.step()
    params = list(model.parameters())
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optim": storage_bytes(optim_tensors(local_opt)),
    }


def main() -> None:
    out, hf_config, gpt_spec, kinds = sys.argv[1:5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for kind in kinds.split(","):
        tp = ["tp2"] if kind == "gpt" and dist.get_world_size() % 2 == 0 else []
        for strategy in ("ddp", "zero1", "fsdp_full", *tp):
            mine = run_case(kind, strategy, hf_config, gpt_spec)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            results[f"{kind}/{strategy}"] = every
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
