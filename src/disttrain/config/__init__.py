"""Configuration: typed sections (kw_only dataclasses), a TOML file and dotted CLI
overrides, and the pure rules the layers above validate against. It sits above the
plain-file and error modules (docs/architecture.md, "The layers").
Nothing here imports torch at module level.

    schema.py    Config and its sections; load_config; validate / validate_parallel
    tomlfile.py  TOML reading, dotted overrides, typed construction
    gpt_shape.py GPTConfig: the built-in model's shape as plain data
    user_code.py rules for the keys that name user code (model.factory, data.factory, train.loss)
    lr_rule.py   g(B): the LR multiplier of an effective batch (P-LOOP-4)
    key_docs.py  every key with its type, default and meaning (`disttrain train --help`)
    path_keys.py the keys that hold paths, and the base each is read from
    paths.py     paths a command writes, checked before anything is written
    fp8_rules.py what precision fp8 accepts (devices, layers, recipes), for validate, wrap and plan
    rules.py, data_config.py, elastic_config.py, log_config.py, hf_model_config.py:
                 the rules and sections of their names
"""

from disttrain.config.gpt_shape import GPTConfig
from disttrain.config.schema import (
    PRECISIONS,
    SHARDINGS,
    STRATEGIES,
    CheckpointConfig,
    Config,
    DataConfig,
    ElasticConfig,
    GuardConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    check_fsdp1,
    load_config,
    shard_grid,
    to_dict,
    validate,
    validate_parallel,
)

__all__ = [
    "PRECISIONS",
    "SHARDINGS",
    "STRATEGIES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "ElasticConfig",
    "GPTConfig",
    "GuardConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_fsdp1",
    "load_config",
    "shard_grid",
    "to_dict",
    "validate",
    "validate_parallel",
]
