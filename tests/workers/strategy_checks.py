"""Worker: every strategy check of issue 3 in one process-group launch per world size.

`python strategy_checks.py OUT GROUP[,GROUP...]` under torchrun; each rank writes
OUT/rank{r}.json. Groups: parity (strategy x sharding on GPT and BN-MLP), options
(AC, offload, wrap modes), precision (bf16 tracking, fp16 skip agreement), join,
hf (a Hugging Face GPT-2 from a config), memory. The single-process references are
computed on every rank from the same seed on the full global batch, so no second
launch is needed. Importable: `run(groups)` also serves the world-of-1 test.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

import disttrain as dt
from disttrain.builtin import GPT, MLP, GPTConfig, MLPConfig
from disttrain.parallel.fsdp import full_parameters, local_bytes
from disttrain.parallel.optimizers import decaying

STEPS = 5
GPT_CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
STRATEGY_CASES = [("ddp", "full"), ("zero1", "full")] + [
    (s, m) for s in ("fsdp", "fsdp1") for m in ("full", "grad_op", "hybrid", "none")]


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(prefix, "")
    return name


def trained_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters and buffers by clean name (gathers shards: a collective)."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model):
            values = {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    else:
        values = {_clean(n): p for n, p in full_parameters(model).items()}
    values.update({_clean(n): b for n, b in model.named_buffers() if b.is_floating_point()})
    return values


def max_diff(model: nn.Module, reference: nn.Module) -> float:
    got = trained_values(model)
    want = {n: p for n, p in reference.named_parameters()}
    want.update({n: b for n, b in reference.named_buffers() if b.is_floating_point()})
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


def batches(kind: str, n: int, steps: int = STEPS, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    if kind.startswith("mlp"):
        return [(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)) for _ in range(steps)]
    return [(torch.randint(0, 256, (n, 16), generator=g),) * 2 for _ in range(steps)]


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind.startswith("mlp"):
        # 'mlp': with BatchNorm (the SyncBN parity model); 'mlp_plain': without (fp16 on CPU
        # has no Half BatchNorm kernel).
        return MLP(MLPConfig(batchnorm=kind == "mlp"))
    return GPT(GPT_CFG)


def local_sums(model: nn.Module) -> list[float]:
    """This rank's own shard of every parameter, summed (to compare replicas exactly)."""
    out = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out.append(float(local.detach().double().sum()))
    return out


def train(kind, strategy, sharding, *, precision="fp32", per_rank=None, lr=0.1, scaler=None,
          inject=None, clip=0.0, **options):
    """Train a wrapped copy and a single-process reference; return (model, ref, losses)."""
    info = dt.rank_info()
    r, w = info.rank, info.world_size
    reference = make(kind)
    if kind == "mlp":
        options.setdefault("sync_batchnorm", True)
    model = dt.wrap(copy.deepcopy(reference), strategy=strategy, sharding=sharding,
                    precision=precision, **options)
    per_rank = per_rank or (4 if kind.startswith("mlp") else 2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    opt = dt.make_optimizer(model, torch.optim.SGD, lr=lr, momentum=0.9)
    acc = dt.Accumulator(model, opt, 1, scaler=scaler, grad_clip=clip)
    ref_losses, losses, changed = [], [], []
    for step, (x, y) in enumerate(batches(kind, per_rank * w)):
        ref_opt.zero_grad()
        ref_loss = reference(x, y)[1]
        ref_loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_losses.append(ref_loss.item())
        before = local_sums(model)
        with acc.micro_step():
            loss = model(x[r::w], y[r::w])[1]
            acc.backward(loss)
            if inject is not None and step == inject and r == w - 1:
                p = next(p for p in model.parameters() if p.grad is not None)
                with torch.no_grad():
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).view(-1)[0] = float("inf")
        changed.append(local_sums(model) != before)
        losses.append(dt.global_mean(loss.item(), 1))
    return model, reference, {"ref_losses": ref_losses, "losses": losses, "changed": changed}


def same_decay(model: nn.Module, reference: nn.Module) -> bool:
    """The wrapped model's weight-decay split (canonical names, flags) is the plain one's:
    under FSDP1 its own shapes are 1-D flat-shard views."""
    return [(n, d) for n, _, d in decaying(model)] == [(n, d) for n, _, d in decaying(reference)]


def parity_group(results: dict) -> None:
    w = dt.rank_info().world_size
    for kind in ("gpt", "mlp"):
        for strategy, sharding in STRATEGY_CASES:
            extra = {"shard_group_size": max(1, w // 2)} if sharding == "hybrid" else {}
            # clip 0.5 is active on every step: parity also proves global-norm clipping
            # across shards and replicas (P-LOOP-5).
            model, ref, _ = train(kind, strategy, sharding, clip=0.5, **extra)
            key = f"{kind}/{strategy}/{sharding}"
            results[f"parity/{key}"] = max_diff(model, ref)
            results[f"decay/{key}"] = same_decay(model, ref)
            if sharding == "hybrid":
                results[f"replicas/{key}"] = local_sums(model)
            if kind == "gpt" and strategy == "fsdp":
                m = dt.unwrap(model)
                results[f"tied/{key}"] = m.lm_head.weight is m.tok_emb.weight


def options_group(results: dict) -> None:
    for name, strategy, options in (
            ("fsdp_ac", "fsdp", {"activation_checkpointing": True}),
            ("fsdp_offload", "fsdp", {"cpu_offload": True}),
            ("fsdp_wrap_model", "fsdp", {"wrap": "model"}),
            ("fsdp_wrap_named", "fsdp", {"wrap": "Block"}),
            ("ddp_ac", "ddp", {"activation_checkpointing": True}),
            ("fsdp1_ac", "fsdp1", {"activation_checkpointing": True})):
        model, ref, _ = train("gpt", strategy, "full", **options)
        results[f"option/{name}"] = max_diff(model, ref)
        results[f"decay/option/{name}"] = same_decay(model, ref)
    try:
        dt.wrap(GPT(GPT_CFG), strategy="fsdp", wrap="Embedding")
        results["option/split_tied"] = None
    except dt.ConfigError as e:
        results["option/split_tied"] = str(e)


def precision_group(results: dict) -> None:
    for strategy in ("ddp", "fsdp", "fsdp1"):
        _, _, fp32 = train("gpt", strategy, "full")
        _, _, bf16 = train("gpt", strategy, "full", precision="bf16")
        results[f"bf16/{strategy}"] = max(abs(a - b) for a, b in zip(bf16["losses"], fp32["ref_losses"], strict=False))
        results[f"fp32/{strategy}"] = max(abs(a - b) for a, b in zip(fp32["losses"], fp32["ref_losses"], strict=False))
    for strategy in ("ddp", "zero1", "fsdp"):
        scaler = dt.make_grad_scaler("fp16")
        model, _, log = train("mlp_plain", strategy, "full", precision="fp16", scaler=scaler,
                              inject=2)
        results[f"fp16/{strategy}"] = {"changed": log["changed"], "skipped": scaler.skipped_steps,
                                       "scale": scaler.get_scale(), "sums": local_sums(model),
                                       "losses": log["losses"]}


def join_group(results: dict) -> None:
    r = dt.rank_info().rank
    for strategy in ("ddp", "zero1"):
        torch.manual_seed(0)
        model = dt.wrap(MLP(MLPConfig()), strategy=strategy)
        opt = dt.make_optimizer(model, torch.optim.SGD, lr=0.1)
        mine = batches("mlp", 4, steps=3 + 2 * r, seed=r)
        with dt.join(model, opt):
            for x, y in mine:
                opt.zero_grad()
                model(x, y)[1].backward()
                opt.step()
        results[f"join/{strategy}"] = {"batches": len(mine), "sums": local_sums(model)}


def hf_group(results: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    info = dt.rank_info()
    r, w = info.rank, info.world_size
    cfg = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(cfg)
    model = dt.wrap(copy.deepcopy(reference), strategy="fsdp", sharding="full")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = dt.make_optimizer(model, torch.optim.SGD, lr=0.1)
    ref_losses, losses = [], []
    for x, _ in batches("gpt", 2 * w):
        ref_opt.zero_grad()
        loss = reference(input_ids=x, labels=x).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
        opt.zero_grad()
        loss = model(input_ids=x[r::w], labels=x[r::w]).loss
        loss.backward()
        opt.step()
        losses.append(dt.global_mean(loss.item(), 1))
    m = dt.unwrap(model)
    results["hf"] = {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=False)),
        # fully_shard swaps the class for a subclass named FSDP<Class>.
        "losses": losses, "units": sum(isinstance(b, FSDPModule) and type(b).__name__.endswith("GPT2Block")
                                       for b in m.modules()),
        "tied": m.lm_head.weight is m.transformer.wte.weight,
        "param_diff": max_diff(model, reference)}


def memory_group(results: dict) -> None:
    x, y = batches("gpt", 2, steps=1)[0]
    cfg = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32)
    for strategy in ("ddp", "fsdp", "zero1"):
        torch.manual_seed(0)
        model = dt.wrap(GPT(cfg), strategy=strategy, sharding="full")
        opt = dt.make_optimizer(model, torch.optim.AdamW, lr=1e-3)
        model(x, y)[1].backward()
        opt.step()
        state = opt.optim.state if hasattr(opt, "optim") else opt.state
        params = sum(local_bytes(p) for p in model.parameters())
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optim = sum(local_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v))
        results[f"memory/{strategy}"] = {"params": params, "grads": grads, "optim": optim}


GROUPS = {"parity": parity_group, "options": options_group, "precision": precision_group,
          "join": join_group, "hf": hf_group, "memory": memory_group}


def run(groups: list[str]) -> dict:
    results: dict = {}
    for group in groups:
        GROUPS[group](results)
    return results


if __name__ == "__main__":
    out = Path(sys.argv[1])
    with dt.distributed(seed=0) as info:
        res = run(sys.argv[2].split(","))
        (out / f"rank{info.rank}.json").write_text(json.dumps(res))
