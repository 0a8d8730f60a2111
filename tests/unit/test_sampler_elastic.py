"""ElasticSampler: exactly-once across resumes at other world sizes (P-DATA-1..4)."""

from collections import Counter

import pytest

from disttrain.data import ElasticSampler
from disttrain.errors import UserError


def run_steps(samplers, steps):
    """Consume `steps` global steps from per-rank samplers; return indices in order."""
    seen = []
    iters = [iter(s) for s in samplers]
    per_step = samplers[0].global_batch // samplers[0].world_size
    for _ in range(steps):
        for it in iters:
            seen += [next(it) for _ in range(per_step)]
        for s in samplers:
            s.commit_step()
    return seen


def make(world, n=103, batch=3, accum=2, **kw):
    return [ElasticSampler(n, batch_size=batch, accum_steps=accum, rank=r, world_size=world, seed=4, **kw)
            for r in range(world)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_world_change_2_to_1_to_4_is_exactly_once(drop_last):
    first = make(2, drop_last=drop_last)
    seen = run_steps(first, 5)  # G = 12
    state = first[0].state_dict()
    second = make(1, drop_last=drop_last)
    for s in second:
        s.load_state_dict(state)
    seen += run_steps(second, 3)  # G = 6: the cursor is no longer a multiple of 12
    state = second[0].state_dict()
    third = make(4, batch=1, drop_last=drop_last)  # G = 8
    for s in third:
        s.load_state_dict(state)
    padded = third[0].padded
    seen += run_steps(third, third[0].steps_left())
    counts = Counter(seen)
    if drop_last:
        assert max(counts.values()) == 1 and len(seen) == 60 + 18 + 24  # 1 tail sample dropped
    else:
        assert set(counts) == set(range(103))
        assert len(seen) - 103 == padded == 7  # 78 + 32 = 110 positions: 7 padded, counted
    assert third[0].epoch == 1 and third[0].cursor == 0  # the epoch advanced by itself


def test_order_depends_only_on_seed_and_epoch():
    a = ElasticSampler(50, batch_size=2, rank=0, world_size=2, seed=1)
    b = ElasticSampler(50, batch_size=5, rank=2, world_size=3, seed=1)
    assert a.epoch_order(3) == b.epoch_order(3) != a.epoch_order(4)


def test_rank_shards_are_disjoint_within_a_step():
    samplers = make(3, n=60, batch=2, accum=1)
    parts = [list(s)[:2] for s in samplers]
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == 6 and set(flat) == set(samplers[0].step_indices())


def test_resume_on_other_dataset_is_refused():
    s = make(1)[0]
    other = ElasticSampler(99, batch_size=3, rank=0, world_size=1, seed=4)
    with pytest.raises(UserError, match="built for 103 samples"):
        other.load_state_dict(s.state_dict())
