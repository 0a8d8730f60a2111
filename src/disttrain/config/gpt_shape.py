"""The shape of the built-in GPT (`disttrain.builtin.gpt`), as plain data: the config
layer describes it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class GPTConfig:
    """The shape of the built-in GPT (`[model]` without a factory or a Hugging Face
    model). The defaults give about 0.8M parameters."""

    vocab_size: int = 256
    """Vocabulary size: 256 for bytes; for token files at least their vocabulary."""
    block_size: int = 128
    """Longest context in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; n_embd must divide by it."""
    n_embd: int = 128
    """Width of the embeddings and of each block."""
    dropout: float = 0.0
    """Dropout probability on attention, MLP output and embeddings."""
    bias: bool = True
    """Biases in the linear layers and layer norms."""
