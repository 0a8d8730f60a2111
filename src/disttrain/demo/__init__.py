"""The main job's own parts, outside the library: a small GPT and MLP built from
configs, and the standard-library byte corpus. Used by the trainer's defaults, the
examples, the tests and the benchmarks.
"""

from disttrain.demo.gpt import GPT, Block, GPTConfig
from disttrain.demo.mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "Block", "MLP", "MLPConfig"]
