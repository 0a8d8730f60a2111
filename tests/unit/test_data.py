"""The sampler: disjoint shards, padding semantics, and an epoch that advances itself
(P-DATA-1, P-DATA-2). Pure index arithmetic: no process group needed."""

import pytest

from disttrain.builtin.corpus import ChunkDataset, _is_heldout, stdlib_files
from disttrain.data import DistributedSampler
from disttrain.errors import UserError


def shards(n, world, **kw):
    return [list(DistributedSampler(n, rank=r, world_size=world, **kw)) for r in range(world)]


def test_shards_are_disjoint_and_cover_the_dataset():
    parts = shards(12, 3, seed=5)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(12)) and all(len(p) == 4 for p in parts)


def test_padding_repeats_and_drop_last_drops():
    padded = shards(10, 4, seed=1)
    assert all(len(p) == 3 for p in padded)
    flat = [i for p in padded for i in p]
    assert set(flat) == set(range(10)) and len(flat) == 12  # two samples repeated
    dropped = shards(10, 4, seed=1, drop_last=True)
    flat = [i for p in dropped for i in p]
    assert len(flat) == len(set(flat)) == 8


def test_epoch_advances_without_set_epoch_P_DATA_2():
    s = DistributedSampler(50, rank=0, world_size=2, seed=3)
    first, second = list(s), list(s)
    assert first != second and s.epoch == 2
    s.set_epoch(0)
    assert list(s) == first  # order is a function of (seed, epoch) only


def test_order_does_not_depend_on_rank_layout():
    a = DistributedSampler(40, rank=0, world_size=2, seed=9).global_order(3)
    b = DistributedSampler(40, rank=3, world_size=4, seed=9).global_order(3)
    assert a == b


def test_empty_dataset_and_too_few_samples_are_clear_errors():
    with pytest.raises(UserError, match="dataset is empty"):
        DistributedSampler(0, rank=0, world_size=1)
    with pytest.raises(UserError, match="drop_last=True with 2 samples and 4 ranks"):
        DistributedSampler(2, rank=0, world_size=4, drop_last=True)


def test_corpus_split_is_deterministic_and_heldout_files_are_not_trained_on():
    files = stdlib_files()
    held = [f for f in files if _is_heldout(f, 0.1)]
    assert 0.03 < len(held) / len(files) < 0.2
    assert held == [f for f in stdlib_files() if _is_heldout(f, 0.1)]


def test_chunks_are_next_token_pairs():
    import torch

    ds = ChunkDataset(torch.arange(21), block_size=4)
    x, y = ds[1]
    assert len(ds) == 5 and x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    with pytest.raises(UserError, match="fewer than one window"):
        ChunkDataset(torch.arange(3), block_size=4)
