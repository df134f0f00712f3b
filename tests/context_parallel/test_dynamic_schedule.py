"""Dynamic CP's schedule (context_parallel/dynamic_schedule.py): group sizes, bins within
the per-rank bound, every document placed once, aligned blocks, every rank working, and run
orders that cannot deadlock."""
import random

import pytest

from megatron_cp.config.dynamic_cp import granule, group_size, padded
from megatron_cp.context_parallel.dynamic_schedule import FlopCost, rounds, schedule

COST = FlopCost.for_model(hidden=64, ffn_hidden=256, layers=2, heads=4, kv_heads=2, head_dim=16)


def test_group_size_is_the_smallest_power_of_two_that_holds_the_document():
    assert group_size(100, 128, 8) == 1
    assert group_size(128, 128, 8) == 1
    assert group_size(129, 128, 8) == 2  # Megatron-LM's 2^ceil(log2(129 / 128))
    assert group_size(256, 128, 8) == 2
    assert group_size(257, 128, 8) == 4
    assert group_size(1024, 128, 8) == 8
    # padding for the zigzag split can take one step more than Megatron-LM's rule
    assert padded(255, 2) == 256 and group_size(255, 127, 8) == 4
    # sequence parallelism pads to multiples of TP too
    assert granule(4, 2) == 16 and padded(17, 4, 2) == 32


def test_a_document_too_long_for_the_pool_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="raise it to at least 130"):
        group_size(1030, 128, 8)


@pytest.mark.parametrize("pool,tp_multiple", [(4, 1), (8, 1), (8, 2), (16, 1)])
def test_every_document_runs_once_within_the_bound(pool, tp_multiple):
    rng = random.Random(pool * 10 + tp_multiple)
    max_per_rank = 256
    choices = [n for n in (0, 3, 40, 100, 300, 700, 1500) if n <= pool * max_per_rank * 0.9]
    lengths = [rng.choice(choices) for _ in range(60)]
    s = schedule(lengths, pool, max_per_rank, COST, tp_multiple)
    placed = sorted(d for b in s.bins for d in b.documents)
    assert placed == [d for d, n in enumerate(lengths) if n > 0]
    for b in s.bins:
        assert b.first % b.size == 0 and b.first + b.size <= pool  # an aligned block
        assert [lengths[d] for d in b.documents] == b.lengths
        total = sum(padded(n, b.size, tp_multiple) for n in b.lengths)
        assert total <= b.size * max_per_rank  # each rank holds at most M tokens
        assert b.size >= max(group_size(n, max_per_rank, pool, tp_multiple) for n in b.lengths)
    assert [b.order for b in s.bins] == list(range(len(s.bins)))
    assert all(s.bins_of(r) for r in range(pool))  # every rank works


def test_run_order_cannot_deadlock():
    """Every rank runs its bins by increasing order and a bin waits for all its ranks: the
    lowest unfinished bin can always run, so simulating it always finishes every bin."""
    rng = random.Random(3)
    lengths = [rng.choice([10, 200, 500, 1000]) for _ in range(40)]
    s = schedule(lengths, 8, 128, COST)
    queues = {r: [b.order for b in s.bins_of(r)] for r in range(8)}
    done = set()
    while len(done) < len(s.bins):
        runnable = [b for b in s.bins if b.order not in done
                    and all(queues[r][0] == b.order for r in b.ranks)]
        assert runnable, "no bin can start: the run orders deadlock"
        for b in runnable:
            done.add(b.order)
            for r in b.ranks:
                queues[r].pop(0)


def test_modelled_times_follow_the_run_order():
    s = schedule([900, 900, 60, 60, 60, 60, 30, 30], 4, 256, COST)
    for r in range(4):
        bins = s.bins_of(r)
        for a, b in zip(bins, bins[1:]):
            assert b.start >= a.finish
    assert s.step_time == max(b.finish for b in s.bins)
    # the two long documents each need 4 ranks (900 > 2 x 256), so they run one after another
    long = [b for b in s.bins if b.lengths == [900]]
    assert [b.size for b in long] == [4, 4] and long[1].start == long[0].finish


def test_an_idle_rank_takes_half_of_a_bin():
    # one document that fits one rank: spread until the four ranks share it
    s = schedule([40], 4, 64, COST)
    assert len(s.bins) == 1 and s.bins[0].size == 4


def test_the_pool_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        schedule([10], 6, 64, COST)


def test_the_static_layout_wins_where_it_models_faster():
    """Rule 5: two samples of a 21- and an 11-token document each, at 20 tokens a rank on
    DP2 x CP2: each sample on its own CP group is the better plan (every rank 18 tokens);
    re-packed, some rank runs an 11-token bin and half of a 21-token one (23)."""
    samples = [[0, 1], [2, 3]]
    lengths = [21, 11, 21, 11]
    dynamic = schedule(lengths, 4, 20, COST)
    plan = schedule(lengths, 4, 20, COST, samples=samples, static_size=2)
    assert plan.static and plan.step_time < dynamic.step_time
    assert [(b.documents, b.first, b.size) for b in plan.bins] == [([0, 1], 0, 2), ([2, 3], 2, 2)]
    # one sample of a 64-token document and one of 64 single tokens: re-packed, the long
    # one spreads over all four ranks while nothing else waits: the dynamic plan is kept
    lengths = [64] + [1] * 64
    plan = schedule(lengths, 4, 32, COST, samples=[[0], list(range(1, 65))], static_size=2)
    assert not plan.static


def test_lockstep_rounds_pair_every_bin_and_give_every_rank_the_same_count():
    rng = random.Random(5)
    lengths = [rng.choice([5, 20, 60, 120, 250]) for _ in range(30)]
    s = schedule(lengths, 8, 64, COST)
    per_slot = rounds(s)
    counts = {len(r) for r in per_slot.values()}
    assert len(counts) == 1  # every rank runs the same number of forwards
    for b in s.bins:  # a bin's ranks all run it in the same round, once
        places = {slot: [i for i, x in enumerate(per_slot[slot]) if x is b] for slot in b.ranks}
        assert all(len(p) == 1 for p in places.values())
        assert len({p[0] for p in places.values()}) == 1
    for slot, run in per_slot.items():  # and in each rank's run order
        assert [b for b in run if b is not None] == s.bins_of(slot)
