"""Config errors: one clear message naming the key and the fix, before any process starts."""

import pytest
from conftest import run_disttrain

from disttrain.config import load_config
from disttrain.errors import ConfigError


@pytest.mark.parametrize("overrides, expected", [
    (["--train.stepz=5"], "unknown config key 'train.stepz'. Did you mean 'train.steps'?"),
    (["--train.steps=\"many\""], "config key 'train.steps' must be int"),
    (["--train.accum_steps=0"], "'train.accum_steps' is 0; it must be at least 1"),
    (["--train.batch_size=0"], "'train.batch_size' is 0; it must be at least 1"),
    (["--parallel.nproc=0"], "'parallel.nproc' is 0; it must be at least 1"),
    (["--parallel.strategy=horovod"], "'parallel.strategy' is 'horovod'; choose one of ddp"),
    (["--parallel.device=cuda"], "no CUDA device is visible"),
    (["--parallel.backend=nccl", "--parallel.device=cpu"], "NCCL needs CUDA"),
    (["--model.n_embd=100", "--model.n_head=3"], "must be divisible by model.n_head"),
    (["--optim.lr=-1"], "optim.lr is -1.0; it must be positive"),
    (["--train.steps"], "has no value. Write it as --section.key=value"),
    (["--model=3"], "[model] must be a table"),
    (["--optim.betas=0.9"], "'optim.betas' must be a list"),
])
def test_config_error_names_key_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_overrides_beat_file_beat_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 7\nbatch_size = 3\n[optim]\nlr = 0.5\n")
    cfg = load_config(path, ["--train.steps=9", "--optim.betas=[0.8, 0.9]"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.optim.lr) == (9, 3, 0.5)
    assert cfg.optim.betas == [0.8, 0.9] and cfg.train.accum_steps == 1
    assert isinstance(load_config(None, ["--optim.lr=1"]).optim.lr, float)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)


def test_cli_config_error_is_one_line_without_traceback_and_starts_nothing():
    # refused before anything starts: no process group, no worker (bounded by the timeout)
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", "--train.accum_steps=0"], timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("disttrain train: error: config key 'train.accum_steps' is 0; "
                                   "it must be at least 1.")
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stdout + proc.stderr


def _config_classes(cls=None) -> set[type]:
    """`Config` and every dataclass among its sections' types, their bases included."""
    import dataclasses
    import typing

    from disttrain.config import Config

    cls = cls or Config
    found = {base for base in cls.__mro__ if dataclasses.is_dataclass(base)}
    for hint in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(hint):
            found |= _config_classes(hint)
    return found


def test_every_config_class_is_importable_from_the_package_and_in_the_api_reference():
    """`from disttrain.config import LogConfig` failed, though `Config(log=LogConfig(...))`
    is how a script turns TensorBoard off; the reference (dt.__all__) listed none."""
    import disttrain as dt
    import disttrain.config as config

    classes = _config_classes()
    assert {c.__name__ for c in classes} >= {"Config", "LogConfig", "TrainConfig", "CheckpointConfig"}
    for cls in classes:
        assert cls.__name__ in config.__all__ and getattr(config, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in dt.__all__ and getattr(dt, cls.__name__) is cls, cls.__name__
