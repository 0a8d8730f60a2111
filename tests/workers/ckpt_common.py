"""Shared by the checkpoint workers and tests: a tiny GPT with dropout, AdamW, a
warmup-cosine schedule, a shuffling `ElasticSampler`, and exact comparisons."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import disttrain as dt
from disttrain.builtin import GPT, GPTConfig
from disttrain.checkpoint import TrainState
from disttrain.data import ElasticSampler

CFG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
N_SAMPLES, BATCH = 20, 2


def dataset() -> torch.Tensor:
    g = torch.Generator().manual_seed(42)
    return torch.randint(0, 256, (N_SAMPLES, CFG.block_size + 1), generator=g)


class FusedAttention(nn.Module):
    """The built-in GPT's attention as the committed first-format fixture
    (tests/data/checkpoint_v1) holds it: q, k and v in one `qkv` layer, the same values."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        c, bias = attn.q.in_features, attn.q.bias is not None
        self.head_dim = attn.head_dim
        self.qkv = nn.Linear(c, 3 * c, bias=bias)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]))
            if bias:
                self.qkv.bias.copy_(torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]))
        self.proj, self.dropout, self.resid_drop = attn.proj, attn.dropout, attn.resid_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, c // self.head_dim, self.head_dim).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


def build(strategy: str = "ddp", cfg: GPTConfig = CFG, *, fused: bool = False) -> TrainState:
    """The same model on every rank (seed 0), wrapped, then its optimizer (P-FSDP-7).
    `fused`: the attention of the first-format fixture (`FusedAttention`)."""
    torch.manual_seed(0)
    plain = GPT(cfg)
    for block in plain.blocks if fused else ():
        block.attn = FusedAttention(block.attn)
    model = dt.wrap(plain, strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = dt.warmup_cosine(opt, total_steps=12, warmup_steps=2)
    sampler = ElasticSampler(N_SAMPLES, batch_size=BATCH, seed=3)
    return TrainState(model=model, optimizer=opt, scheduler=sched, sampler=sampler,
                      extras={"ema_loss": torch.zeros(())}, config={"model": "tiny", "lr": 1e-2})


def train(state: TrainState, steps: int, data: torch.Tensor | None = None) -> list[float]:
    """`steps` optimizer steps; returns this rank's per-step losses."""
    data = dataset() if data is None else data
    info = dt.rank_info()
    losses = []
    for _ in range(steps):
        idx = state.sampler.step_indices()[info.rank::info.world_size]
        batch = data[idx]
        _, loss = state.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        dt.clip_grad_norm(state.model, 1.0)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.sampler.commit_step()
        state.step += 1
        state.epoch = state.sampler.epoch
        state.extras["ema_loss"].mul_(0.9).add_(0.1 * loss.detach())
        losses.append(loss.item())
    return losses


def full_state(state: TrainState) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors, gathered full on CPU (rank 0; {} elsewhere)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(state.model, [state.optimizer], options=opts)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, entry in osd.get("state", {}).items():
        flat.update({f"optim.{fqn}.{k}": v for k, v in entry.items()})
    groups = osd.get("param_groups", [])
    flat["optim.lr"] = torch.tensor([g["lr"] for g in groups], dtype=torch.float64)
    return {k: v.detach().clone() if hasattr(v, "detach") else v for k, v in flat.items()}


def mismatches(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bit-identical (or missing on one side)."""
    out = sorted(set(a) ^ set(b))
    out += [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return out


def saved_once(root, steps: int = 1, strategy: str = "ddp") -> TrainState:
    """Train the tiny GPT `steps` steps and commit one checkpoint of it under `root`
    (in this process); returns the state, which a resume may load into again."""
    from disttrain.checkpoint import Checkpointer

    state = build(strategy)
    train(state, steps)
    Checkpointer(root).save(state)
    return state
