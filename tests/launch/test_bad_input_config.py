"""Issue 22, items 2, 3, 7 and 9: every config value a user can type is either refused in
the launching process (one line, exit 2, no worker started) or accepted and trained.

The property test draws a random value (of the key's type or of another one, the
extremes included: nan, inf, 0, negatives, huge numbers, empty and odd strings) for
a random key of every section, on top of a tiny config, and runs what `disttrain
train` runs before it starts a worker: `load_config` (the validation table), the
user-code references, and the preflight (writable directories, the first step's
memory). Each must end in a `Config` or in a `UserError` of one line; anything else
is a value that would reach a worker. A few refusals go through the real CLI (exit 2,
one stderr line); a few accepted values train for one step.
"""

import dataclasses
import json
import math
import typing

import pytest
from conftest import run_disttrain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.config import Config, load_config
from disttrain.errors import UserError
from disttrain.launch.preflight import preflight

pytestmark = pytest.mark.timeout(240)

TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.block_size=32",
        "--data.max_bytes=50000", "--train.batch_size=4", "--train.steps=1", "--train.eval_every=0",
        "--train.eval_batches=1", "--train.log_every=1", "--parallel.nproc=1", "--guard.enabled=false"]


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


KEYS = dict(_leaves(Config))
SPECIAL_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e300, -1e300, 5e-324])
FLOATS = st.one_of(SPECIAL_FLOATS, st.floats(allow_nan=True, allow_infinity=True))
INTS = st.one_of(st.sampled_from([0, -1, 1, 2, 255, 256, 2**31, 2**32, 2**62, -(2**62)]),
                 st.integers(-10**6, 10**6))
WORDS = st.sampled_from(["", " ", "auto", "ddp", "fsdp", "zero1", "dp", "fsdp1", "cpu", "cuda", "gloo",
                         "nccl", "full", "hybrid", "none", "grad_op", "fp16", "bf16", "fp8", "rowwise", "adamw", "sgd",
                         "stdlib", "thread", "continue", "a:b", "os:getcwd", "no such", "../x",
                         "keep_global", "rescale_lr", "é", "model", "uint32"])
TEXT = st.one_of(WORDS, st.text(max_size=6))


def _typed(tp):
    origin = typing.get_origin(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return INTS
    if tp is float:
        return FLOATS
    if tp is str:
        return TEXT
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(_typed(item), max_size=4)
    if tp is dict or origin is dict:
        return st.dictionaries(st.sampled_from(["a", "n", "lr"]), st.one_of(INTS, FLOATS, WORDS), max_size=2)
    return st.none()


def _any_value(tp):
    """Mostly the key's own type, sometimes another type (a typo's shape)."""
    return st.one_of(_typed(tp), _typed(tp), _typed(tp), st.booleans(), INTS, FLOATS, TEXT,
                     st.lists(INTS, max_size=3))


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


ASSIGNMENTS = st.sampled_from(sorted(KEYS)).flatmap(
    lambda key: st.tuples(st.just(key), _any_value(KEYS[key])))


def launcher_checks(overrides: list[str]):
    """What `disttrain train` runs before any worker: the config, the user code it names,
    the preflight. Returns the Config, or raises `UserError`."""
    cfg = load_config(None, overrides)
    if cfg.model.factory or cfg.data.factory or cfg.train.loss:
        from disttrain.train.model_data_loss import check_references

        check_references(cfg, ".")
    preflight(cfg)
    return cfg


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(assignments=st.lists(ASSIGNMENTS, min_size=1, max_size=3))
def test_every_value_is_refused_in_one_line_or_accepted(tmp_path, assignments):
    overrides = TINY + [f"--train.out_dir={tmp_path / 'run'}"]
    overrides += [f"--{key}={toml_literal(value)}" for key, value in assignments]
    try:
        cfg = launcher_checks(overrides)
    except UserError as e:
        message = str(e)
        assert message.strip() and "\n" not in message.strip(), (overrides, message)
        return
    for key, _ in assignments:  # what was accepted is what a worker gets: all finite
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert not (isinstance(value, float) and not math.isfinite(value)), (key, value)


@pytest.mark.parametrize("bad, words", [
    ("--optim.lr=inf", "'optim.lr' is inf; it must be a finite number"),
    ("--model.n_embd=0", "'model.n_embd' is 0"),
    ("--model.vocab_size=10", "the byte corpus has 256 symbols"),
    ("--data.max_bytes=0", "'data.max_bytes' is 0"),
    ("--optim.betas=[1.5,2.0,3.0]", "'optim.betas' is [1.5, 2.0, 3.0]"),
    ("--parallel.timeout_s=inf", "'parallel.timeout_s' is inf"),
    ("--optim.weight_decay=-0.1", "'optim.weight_decay' is -0.1"),
    ("--optim.warmup_steps=-5", "'optim.warmup_steps' is -5"),
    ("--train.out_dir=", "'train.out_dir' is ''"),
])
def test_9_values_that_crashed_workers_are_refused_before_any_worker(bad, words):
    with pytest.raises(UserError, match="^" + ".*" + words.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        launcher_checks(TINY + [bad])


def test_9_a_toml_file_that_is_a_directory_or_not_utf8_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        load_config(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[train]\nout_dir = \"r\xe9sultats\"\n".encode("latin-1"))
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_config(bad)


def test_3_an_unwritable_out_dir_or_checkpoint_dir_is_refused_before_any_worker(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    base = TINY + [f"--train.out_dir={tmp_path / 'run'}"]
    with pytest.raises(UserError, match="checkpoint.dir .* is a file, not a directory"):
        launcher_checks(base + [f"--checkpoint.dir={a_file}"])
    with pytest.raises(UserError, match="train.out_dir .* is a file"):
        launcher_checks(TINY + [f"--train.out_dir={a_file / 'sub'}"])
    assert a_file.read_text() == "keep me" and not (tmp_path / "run").exists()


def test_7_a_first_step_that_cannot_fit_is_refused_with_the_numbers(tmp_path):
    with pytest.raises(UserError, match=r"^the first step needs about .* train.batch_size=100000000"):
        launcher_checks(TINY + ["--train.batch_size=100000000", f"--train.out_dir={tmp_path}"])
    launcher_checks(TINY + [f"--train.out_dir={tmp_path}"])  # the tiny one fits


@pytest.mark.parametrize("bad", ["--optim.lr=inf", "--train.batch_size=100000000"])
def test_cli_refusals_are_one_line_exit_2_and_start_no_worker(tmp_path, bad):
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", bad, f"--train.out_dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("disttrain train: error: ")
    assert not any(tmp_path.iterdir())  # nothing written: no worker started


@pytest.mark.slow
def test_accepted_values_train_one_step(tmp_path):
    accepted = ["--optim.name=sgd", "--optim.momentum=0.5", "--train.accum_steps=2", "--model.dropout=0.5"]
    proc = run_disttrain(["train", "examples/tiny_gpt.toml", *TINY, *accepted, "--checkpoint.enabled=false",
                          "--log.tensorboard=false", f"--train.out_dir={tmp_path}"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_3_a_read_only_filesystem_is_named(tmp_path, monkeypatch):
    import errno

    from disttrain.config import paths

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)  # root passes every permission bit
    with pytest.raises(UserError, match="train.out_dir .* cannot be written: .*read-only filesystem"):
        launcher_checks(TINY + [f"--train.out_dir={tmp_path / 'run'}"])
