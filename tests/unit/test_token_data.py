"""Data on disk: token files (nanoGPT raw, llm.c headered), `disttrain data prepare`,
and Hugging Face `datasets` folders, each through the ElasticSampler with the sample
audit: every sample once across a kill and a resize 2 -> 1 -> 2 (P-DATA-3,
P-ELASTIC-3). Pure index arithmetic and small files: no process group."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from token_writers import write_llmc, write_raw
from torch.utils.data import DataLoader

from disttrain.cli import main as cli_main
from disttrain.config import load_config
from disttrain.data import ElasticSampler
from disttrain.data.prepare import prepare
from disttrain.data.token_files import LLMC_MAGIC, read_token_file, token_datasets
from disttrain.errors import ConfigError, UserError
from disttrain.train.model_data_loss import build_datasets

pytestmark = pytest.mark.timeout(120)


def test_both_formats_are_cut_into_windows_that_never_cross_files(tmp_path):
    write_llmc(tmp_path / "a.bin", np.arange(0, 21))  # 21 tokens, block 4: 5 windows
    write_raw(tmp_path / "b.bin", np.arange(100, 110))  # 10 tokens: 2 windows
    write_raw(tmp_path / "val.bin", np.arange(200, 209))  # held out by its name
    train, held, summary = token_datasets(str(tmp_path), 4)
    assert (len(train), len(held), summary["heldout_split"]) == (7, 2, "file")
    x, y = train[0]
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4] and x.dtype.is_floating_point is False
    assert train[4][1].tolist() == [17, 18, 19, 20]
    assert train[5][0].tolist() == [100, 101, 102, 103]  # the next file starts a new window
    assert held[1][0].tolist() == [204, 205, 206, 207]
    with pytest.raises(IndexError):
        train[7]


def test_heldout_by_fraction_is_the_tail_and_never_trained_on(tmp_path):
    write_raw(tmp_path / "train.bin", np.arange(401))  # 100 windows of 4
    train, held, summary = token_datasets(str(tmp_path / "*.bin"), 4, heldout_fraction=0.1)
    assert (len(train), len(held), summary["heldout_split"]) == (90, 10, "fraction")
    train_starts = {int(train[i][0][0]) for i in range(len(train))}
    held_starts = {int(held[i][0][0]) for i in range(len(held))}
    assert not train_starts & held_starts and max(train_starts) < min(held_starts)


@pytest.mark.parametrize("make, words", [
    (lambda p: write_raw(p, np.arange(9)).write_bytes(p.read_bytes() + b"\0"), "not a whole number of uint16"),
    (lambda p: write_llmc(p, np.arange(50), count=60), "header says 60 tokens"),
    (lambda p: write_llmc(p, np.arange(50), version=7), "header version 7"),
    (lambda p: p.write_bytes(np.array([LLMC_MAGIC, 1, 3], dtype="<i4").tobytes()), "less than the 1024-byte header"),
])
def test_a_malformed_file_is_one_line_naming_it(tmp_path, make, words):
    bad = tmp_path / "shard_000.bin"
    make(bad)
    with pytest.raises(UserError) as err:
        token_datasets(str(tmp_path), 4)
    message = str(err.value)
    assert words in message and str(bad) in message and "\n" not in message


def test_llmc_version_2_is_uint32(tmp_path):
    f = read_token_file(write_llmc(tmp_path / "big.bin", [70_000, 1, 2], version=2))
    assert (f.count, f.dtype, f.format) == (3, np.uint32, "llmc")


def _audit(dataset, key, kill_at: int, drop_last: bool = False) -> tuple[Counter, int]:
    """Consume one epoch of `dataset` with world 2, a kill (the uncommitted step is
    lost), world 1, then world 2 again, through DataLoaders as a loop would. Returns
    how often each sample key was consumed by a committed step, and the padding."""
    n, seen, state = len(dataset), Counter(), None

    def run(world: int, steps: int | None, lose_last: bool = False) -> dict:
        samplers = [ElasticSampler(n, batch_size=2, world_size=world, rank=r, seed=3, drop_last=drop_last)
                    for r in range(world)]
        for s in samplers:
            if state:
                s.load_state_dict(state)
        loaders = [iter(DataLoader(dataset, batch_size=2, sampler=s)) for s in samplers]
        todo = samplers[0].steps_left() if steps is None else steps
        for step in range(todo):
            batches = [next(it) for it in loaders]
            if lose_last and step == todo - 1:
                break  # kill -9 mid-step: this step never commits
            for batch in batches:
                seen.update(key(batch))
            for s in samplers:
                s.commit_step()
        return samplers[0].state_dict()

    state = run(2, kill_at, lose_last=True)
    state = run(1, 5)
    padded = ElasticSampler(n, batch_size=2, world_size=2, rank=0, seed=3, drop_last=drop_last)
    padded.load_state_dict(state)
    pad = padded.padded
    run(2, None)
    return seen, pad


def test_token_windows_every_sample_once_across_a_kill_and_2_1_2(tmp_path):
    write_llmc(tmp_path / "a_000.bin", np.arange(0, 161))  # 40 windows of 4
    write_raw(tmp_path / "b_000.bin", np.arange(1000, 1090))  # 22 windows
    train, _, _ = token_datasets(str(tmp_path), 4, heldout_fraction=0.05)
    starts = [int(train[i][0][0]) for i in range(len(train))]
    assert len(set(starts)) == len(train) == 59  # 62 windows, the last 3 held out
    seen, pad = _audit(train, lambda b: b[0][:, 0].tolist(), kill_at=4)
    assert set(seen) == set(starts)
    assert sum(seen.values()) - len(starts) == pad and sum(c > 1 for c in seen.values()) <= pad


def test_prepare_writes_bytes_and_resumes_by_file(tmp_path, capsys):
    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "a.txt").write_text("hello world\n" * 50)
    (texts / "sub" / "b.txt").write_text("def f(x):\n    return x\n" * 30)
    out = tmp_path / "tokens"
    assert cli_main(["data", "prepare", str(texts / "a.txt"), str(texts / "sub" / "b.txt"),
                     "--out", str(out), "--quiet"]) == 0
    assert "2 file(s) written" in capsys.readouterr().out
    f = read_token_file(out / "sub__b.bin")
    assert f.format == "llmc" and f.count == len((texts / "sub" / "b.txt").read_bytes())
    tokens = np.memmap(f.path, dtype=f.dtype, mode="r", offset=f.offset)
    assert bytes(tokens.astype(np.uint8)) == (texts / "sub" / "b.txt").read_bytes()
    # a killed run leaves a temporary file; a changed input is written again, the rest skipped
    (out / ".a.bin.tmp-999").write_bytes(b"partial")
    (texts / "a.txt").write_text("changed\n")
    report = prepare([texts / "a.txt", texts / "sub" / "b.txt"], out, progress=False)
    assert (report.written, report.skipped) == (["a.bin"], ["sub__b.bin"])
    assert not list(out.glob(".*tmp*")) and read_token_file(out / "a.bin").count == 8


def test_prepare_with_a_local_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = "the quick brown fox jumps over the lazy dog\n" * 40
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text(text)
    report = prepare([tmp_path / "doc.txt"], tmp_path / "out", tokenizer=str(tmp_path / "tokenizer.json"),
                     fmt="nanogpt", progress=False)
    f = read_token_file(tmp_path / "out" / "doc.bin")
    ids = np.fromfile(f.path, dtype=f.dtype).tolist()
    assert f.format == "nanogpt" and ids == tok.encode(text).ids and report.vocab_size <= 80
    with pytest.raises(UserError, match="prepared with"):  # another vocabulary, same folder
        prepare([tmp_path / "doc.txt"], tmp_path / "out", progress=False)


def test_config_keys_relative_paths_and_vocabulary(tmp_path):
    (tmp_path / "doc.txt").write_bytes(bytes(range(256)) * 4)
    prepare([tmp_path / "doc.txt"], tmp_path / "data", progress=False)
    config = tmp_path / "job.toml"
    config.write_text('[model]\nblock_size = 16\n[data]\ntokens = "data"\n')
    train, held, summary = build_datasets(load_config(config), tmp_path)
    assert len(train) + len(held) == (1024 - 1) // 16 and summary["train_files"] == 1
    with pytest.raises(UserError, match="model.vocab_size is 100; set model.vocab_size to at least 256"):
        build_datasets(load_config(config, ["--model.vocab_size=100"]), tmp_path)
    with pytest.raises(ConfigError, match="data.factory, data.tokens"):
        load_config(config, ["--data.factory=mod:fn"])
    with pytest.raises(ConfigError, match="data.tokens_dtype"):
        load_config(config, ["--data.tokens_dtype=float32"])


def test_cli_error_is_one_line(tmp_path, capsys):
    assert cli_main(["data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.txt does not exist" in err and "\n" not in err


def _hf_folder(tmp_path: Path, n: int = 37, block: int = 8) -> Path:
    datasets = pytest.importorskip("datasets")
    rows = [[(i * 7 + j) % 256 for j in range(block + 1)] for i in range(n)]
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"input_ids": rows, "row": list(range(n))}),
        "validation": datasets.Dataset.from_dict({"input_ids": rows[:5], "row": list(range(5))}),
    })
    dd.save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_hf_dataset_every_row_once_across_a_kill_and_2_1_2(tmp_path):
    from disttrain.data.hf_data import hf_datasets

    folder = _hf_folder(tmp_path)
    rows, held, _ = hf_datasets(folder, ["row", "input_ids"], block_size=8)
    assert len(rows) == 37 and len(held) == 5 and set(rows[3]) == {"row", "input_ids"}
    seen, pad = _audit(rows, lambda b: b["row"].tolist(), kill_at=3, drop_last=False)
    assert set(seen) == set(range(37)) and sum(seen.values()) - 37 == pad
    pairs, _, _ = hf_datasets(folder, ["input_ids"], block_size=8)
    x, y = pairs[2]
    assert x.tolist()[1:] == y.tolist()[:-1] and len(x) == 8


def test_hf_dataset_config_and_errors_are_one_line(tmp_path):
    _hf_folder(tmp_path)
    config = tmp_path / "job.toml"
    config.write_text('[model]\nblock_size = 8\n[data]\nhf_dataset = "hf"\n')
    train, held, _ = build_datasets(load_config(config), tmp_path)
    assert len(train) == 37 and len(held) == 5
    for overrides, words in ((["--data.hf_columns=[\"text\"]"], "has the columns"),
                             (["--data.hf_split=dev"], "has the splits"),
                             (["--model.block_size=4"], r"needs 2 to block_size \+ 1 = 5")):
        with pytest.raises(UserError, match=words) as err:
            build_datasets(load_config(config, overrides), tmp_path)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not a Hugging Face datasets folder"):
        build_datasets(load_config(config, [f"--data.hf_dataset={tmp_path}"]), tmp_path)


def test_workers_map_the_files_themselves_and_a_pickle_carries_no_tokens(tmp_path):
    import pickle

    write_llmc(tmp_path / "a.bin", np.arange(4001) % 60_000)
    train, _, _ = token_datasets(str(tmp_path), 8, heldout_fraction=0.01)
    first = train[3]  # maps the file in this process
    assert len(pickle.dumps(train)) < 2000
    loader = DataLoader(train, batch_size=4, num_workers=1, sampler=list(range(8)))
    x, _ = next(iter(loader))
    assert x[3].tolist() == first[0].tolist()


def test_a_missing_heldout_split_is_one_line(tmp_path):
    """docs/data.md promises one line for a split the folder lacks; a named held-out split
    that does not exist used to leave the run without its evaluation, silently."""
    _hf_folder(tmp_path)
    config = tmp_path / "job.toml"
    config.write_text('[model]\nblock_size = 8\n[data]\nhf_dataset = "hf"\nhf_heldout_split = "test"\n')
    with pytest.raises(UserError) as err:
        build_datasets(load_config(config), tmp_path)
    message = str(err.value)
    assert "data.hf_heldout_split is 'test'" in message and "train, validation" in message
    assert "\n" not in message
    _, held, _ = build_datasets(load_config(config, ["--data.hf_heldout_split="]), tmp_path)
    assert held is None  # '' asks for no held-out set


def test_a_wrong_hf_dataset_is_reported_before_any_worker_starts(tmp_path):
    """`disttrain train` with 2 ranks and a data.hf_dataset folder that does not exist: one
    line from the launching process, exit 2; no rank was started (it used to fail in
    every worker, after the launch)."""
    pytest.importorskip("datasets")
    config = tmp_path / "job.toml"
    config.write_text('[model]\nblock_size = 8\n[data]\nhf_dataset = "no_such_folder"\n'
                      f'[parallel]\nnproc = 2\n[train]\nout_dir = "{tmp_path / "run"}"\n')
    from conftest import run_disttrain

    proc = run_disttrain(["train", str(config)], timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout[-2000:] + err[-2000:]
    assert "data.hf_dataset" in err and "no_such_folder is not a folder" in err and "\n" not in err, err
    assert "rank" not in proc.stdout + err  # no worker, no launcher report
