"""A small byte-level GPT (decoder-only transformer) with tied embedding and LM head.

Each transformer layer is a `Block`, the unit that FSDP shards and that activation
checkpointing wraps; `GPT.tp_plan` says how tensor parallelism splits it. Built from
a config alone: no download, random init seeded by the caller.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from disttrain.config.gpt_shape import GPTConfig


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with separate q, k and v projections.

    The head count is read from the projections' output width, so under tensor
    parallelism (q, k, v split by columns, `proj` by rows) each rank runs its own
    `n_head / tp` heads without knowing the degree.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]  # this rank's heads x head_dim: all of them without TP
        q, k, v = (z.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, width)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. `forward(idx, targets)` returns (logits, loss or None).

    The LM head shares its weight with the token embedding (weight tying), so the
    parameter list holds that tensor once.
    """

    # Read by FSDP auto-wrapping, as for Hugging Face models.
    _no_split_modules = ["Block"]
    # Read by `parallel.tensor_parallel` under parallel.tp > 1: each rank computes its own
    # heads (q, k, v by columns) and its slice of the MLP's hidden width; the output
    # projections (by rows) sum the slices. The tied embedding and LM head stay whole.
    tp_plan = {
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

    def tp_plan_for(self, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, object]:
        """`tp_plan` with its options, as torch styles where the strings do not suffice.

        `sequence_parallel`: the residual stream between the layers holds this rank's
        1/tp of the sequence; the norms run on it (`SequenceParallel`), each attention
        and MLP gathers the whole sequence on entry and its output projection
        reduce-scatters back to the slice (instead of an all-reduce). The embedding's
        output is sliced, and the final norm's gathered again for the LM head.
        `loss_parallel`: the LM head splits by columns (vocabulary) and keeps its
        output split (a DTensor, `Shard(-1)`); the tied embedding splits by the same
        rows, so the tie holds. The sequence length must divide by the degree.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        plan: dict[str, object] = dict(self.tp_plan)
        seq, whole = Shard(1), Replicate()
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,))
            plan |= {
                "drop": PrepareModuleOutput(output_layouts=(whole,), desired_output_layouts=(seq,)),
                "blocks.*.ln1": SequenceParallel(),
                "blocks.*.ln2": SequenceParallel(),
                "blocks.*.attn": gather,
                "blocks.*.mlp": gather,
                "blocks.*.attn.proj": RowwiseParallel(output_layouts=seq),
                "blocks.*.mlp.2": RowwiseParallel(output_layouts=seq),
                "ln_f": SequenceParallel(),
            }
        head_input = seq if sequence_parallel else whole
        if loss_parallel:
            plan["tok_emb"] = RowwiseParallel(input_layouts=whole)
            plan["lm_head"] = ColwiseParallel(
                input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False
            )
        elif sequence_parallel:
            plan["lm_head"] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True
            )
        return plan

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scaling of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
