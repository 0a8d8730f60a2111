"""Token files in any loop: the public `dt.TokenWindows` in a dt.Job script, and
`[data] tokens` beside `model.factory` in `disttrain train` (its window length from
`data.block_size`). Each consumes every window of the epoch once across a kill -9 and
a resize 2 -> 1 -> 2 (the sample audit, P-DATA-3, P-ELASTIC-3); each mistake names the
keys in use."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import WORKERS, run_disttrain, worker_env
from elastic_helpers import audit_timeline, metrics
from token_writers import write_llmc, write_raw

import disttrain as dt
from disttrain.config import load_config
from disttrain.errors import ConfigError, UserError

WINDOWS, PER_STEP = 192, 8  # 2 files of 96 windows of 8 tokens; 8 windows per step at any world size
STEPS = WINDOWS // PER_STEP


def _token_folder(root: Path) -> Path:
    folder = root / "tokens"
    folder.mkdir()
    write_raw(folder / "train_a.bin", np.arange(96 * 8 + 1) % 64)  # nanoGPT: raw uint16
    write_llmc(folder / "train_b.bin", (np.arange(96 * 8 + 1) * 7) % 64)  # llm.c: header + tokens
    write_raw(folder / "val.bin", np.arange(8 * 8 + 1) % 64)  # held out by its name
    return folder


def test_token_windows_takes_paths_globs_and_lists(tmp_path):
    folder = _token_folder(tmp_path)
    assert len(dt.TokenWindows(folder, block_size=8)) == 96 + 96  # the training files only
    assert len(dt.TokenWindows(folder, 8, split="heldout")) == len(dt.TokenWindows(folder / "val.bin", 8)) == 8
    assert len(dt.TokenWindows(folder, 8, split="all")) == 96 + 96 + 8
    train = dt.TokenWindows([folder / "train_a.bin", str(folder / "train_b.bin")], 8)
    assert len(train) == len(dt.TokenWindows(str(folder / "train_*.bin"), 8)) == 192
    x, y = train[96]  # the llm.c file's first window: its header is not tokens
    assert x.tolist() == [(7 * i) % 64 for i in range(8)] and y.tolist() == [(7 * i) % 64 for i in range(1, 9)]
    with pytest.raises(UserError, match="TokenWindows: block_size is 0"):
        dt.TokenWindows(folder, 0)
    with pytest.raises(UserError, match=r"TokenWindows\(paths\) = '.*nothing\*\.bin' matches no file"):
        dt.TokenWindows(str(folder / "nothing*.bin"), 8)
    # the script's arguments, not the config's keys
    with pytest.raises(UserError, match=r"^TokenWindows\(dtype=...\) is 'int8'; choose one of"):
        dt.TokenWindows(folder, 8, dtype="int8")
    with pytest.raises(UserError, match=r"split='heldout'\): none of its 1 file"):
        dt.TokenWindows(str(folder / "train_a*.bin"), 8, split="heldout")


def _check_every_window_once(out: Path) -> None:
    timeline = audit_timeline(out)
    assert sorted(timeline) == list(range(1, STEPS + 1))
    counts = Counter(i for step in timeline.values() for i in step)
    assert sorted(counts) == list(range(WINDOWS)) and set(counts.values()) == {1}
    worlds = [m["world_size"] for m in metrics(out)]
    assert 1 in worlds and worlds[-1] == 2


def _kill_resize(out: Path, command) -> None:
    """Three attempts: 2 ranks killed -9 at step 5 (no restart), 1 rank preempted at step
    11 (SIGTERM: saves, exits 0), 2 ranks to the end of the epoch."""
    for nproc, fault, ok in (("2", "kill@backward:rank=1,step=5", False), ("1", "term@step:rank=0,step=11", True),
                             ("2", "", True)):
        env = worker_env(**({"DISTTRAIN_FAULT": fault} if fault else {}))
        proc = run_disttrain(["run", "--nproc", nproc, "--max-restarts", "0", *command], timeout=240, env=env)
        log = proc.stdout + proc.stderr
        assert (proc.returncode == 0) == ok, log[-3000:]
        if fault.startswith("kill"):
            assert "disttrain fault: kill" in log, log[-3000:]
        else:
            assert "resumed at step" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_script_on_token_windows_uses_every_window_once_across_kill_and_2_1_2(tmp_path):
    folder = _token_folder(tmp_path)
    out = tmp_path / "run"
    _kill_resize(out, [str(WORKERS / "token_job.py"), str(out), str(folder / "train_*.bin"), str(STEPS)])
    _check_every_window_once(out)


CONFIG = """
[model]
factory = "token_model:build"
[model.kwargs]
context = 8
[data]
tokens = "tokens"
block_size = 8
drop_last = true
[train]
steps = {steps}
batch_size = 4
eval_every = 0
eval_batches = 1
log_every = 1
[checkpoint]
every = 2
[elastic]
record_samples = true
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_with_model_factory_and_tokens_uses_every_window_once_across_kill_and_2_1_2(tmp_path):
    _token_folder(tmp_path)
    (tmp_path / "cfg.toml").write_text(CONFIG.format(steps=STEPS))
    out = tmp_path / "run"
    _kill_resize(out, ["-m", "disttrain.train", str(tmp_path / "cfg.toml"), f"--train.out_dir={out}"])
    _check_every_window_once(out)
    assert (out / "summary.json").is_file()


def test_tokens_beside_a_model_of_ones_own_needs_data_block_size(tmp_path):
    text = CONFIG.format(steps=4).replace("block_size = 8\n", "")
    (tmp_path / "cfg.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.toml")
    message = str(err.value)
    assert "'data.tokens' and 'model.factory' are set but 'data.block_size' is not" in message
    assert "data.factory" not in message and "\n" not in message
    (tmp_path / "cfg.toml").write_text('[model]\nblock_size = 64\n[data]\ntokens = "tokens"\n')
    with pytest.raises(
        ConfigError, match="'data.block_size' is 100, more than the built-in GPT's model.block_size \\(64\\)"
    ):
        load_config(tmp_path / "cfg.toml", ["--data.block_size=100"])


def test_a_first_batch_the_model_refuses_names_the_data_key_in_use(tmp_path):
    """A token-file run whose model.factory model rejects (x, y) names data.tokens (the
    message said data.factory, which was not set)."""
    import torch

    from disttrain.train.batches import batch_loss
    from disttrain.train.model_data_loss import build_datasets, data_key

    _token_folder(tmp_path)
    (tmp_path / "cfg.toml").write_text(CONFIG.format(steps=4))
    cfg = load_config(tmp_path / "cfg.toml")
    assert data_key(cfg) == "data.tokens"
    train, _, _ = build_datasets(cfg, tmp_path)
    x, y = train[0]
    with pytest.raises(UserError) as err:
        batch_loss(torch.nn.Linear(8, 8), (x[None], y[None]), None, first=True, data=data_key(cfg))
    assert "Make data.tokens's samples match" in str(err.value) and "data.factory" not in str(err.value)
