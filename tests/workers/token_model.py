"""A model of a user's own over token windows (tests/faults/test_token_windows.py): forward(x, y)
returns the next-token loss; `context` is its window length, which the data sets."""

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, context: int):
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x, y):
        if x.shape[1] > self.context:
            raise ValueError(f"a window of {x.shape[1]} tokens is longer than the context {self.context}")
        h = torch.tanh(self.emb(x) + self.pos[: x.shape[1]])
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(vocab: int = 64, dim: int = 16, context: int = 8) -> TinyLM:
    return TinyLM(vocab, dim, context)
