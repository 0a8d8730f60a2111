"""Small reference models used by the trainer, the examples, the tests and the benchmarks."""

from disttrain.models.gpt import GPT, GPTConfig, Block
from disttrain.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "Block", "MLP", "MLPConfig"]
