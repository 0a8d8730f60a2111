"""The shape of the built-in GPT (`disttrain.demo.gpt`), as plain data: the config
layer describes it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the model. Defaults give about 0.8M parameters."""

    vocab_size: int = 256
    """Bytes: 256 symbols."""
    block_size: int = 128
    """Longest context in tokens."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    """Dropout probability on attention, MLP output and embeddings."""
    bias: bool = True

