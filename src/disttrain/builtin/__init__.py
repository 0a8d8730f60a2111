"""The built-in model and data, outside the library: a small GPT and MLP built from
configs, and the standard-library byte corpus. `disttrain train` trains the GPT on the
corpus when its config names no model or data of the user's; the examples, the tests
and the benchmarks use them too.
"""

from disttrain.builtin.gpt import GPT, Block, GPTConfig
from disttrain.builtin.mlp import MLP, MLPConfig

__all__ = ["GPT", "GPTConfig", "Block", "MLP", "MLPConfig"]
