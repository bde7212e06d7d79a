"""Packers: every example placed once, no row over capacity, determinism, rank balance, and the
reference figures of `leansft simulate`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leansft.core.batching.packing import STRATEGIES, bfd_assign, deal_to_ranks, pack
from leansft.tools.stats import lognormal_lengths, plan_summary, recommend_max_length

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=300).map(np.array)


def coverage(plan, lengths):
    """Tokens of each example covered by the plan's pieces."""
    got = np.zeros(len(lengths), dtype=np.int64)
    np.add.at(got, plan.example, plan.length)
    return got


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cap=st.integers(8, 256), strategy=st.sampled_from(STRATEGIES))
def test_every_example_assigned_and_rows_fit(lengths, cap, strategy):
    plan = pack(strategy, lengths, cap, batch_size=4, window=16, seed=1)
    got = coverage(plan, lengths)
    if strategy in ("bfd_split", "wrapped"):
        assert np.array_equal(got, lengths)  # nothing lost, pieces cover each example exactly
    else:
        assert np.array_equal(got, np.minimum(lengths, cap))
        assert np.array_equal(np.sort(plan.example), np.arange(len(lengths)))
        assert plan.truncated == int((lengths > cap).sum())
    assert (plan.length <= cap).all()
    if strategy in ("bfd", "bfd_split", "wrapped"):
        assert (plan.row_tokens <= cap).all()
    else:
        assert (plan.row_sizes <= 4).all()


@settings(max_examples=60, deadline=None)
@given(sizes=lengths_st, cap=st.integers(300, 600))
def test_bfd_matches_a_naive_best_fit(sizes, cap):
    row_of, n_rows = bfd_assign(sizes, cap)
    # naive reference: one item at a time, tightest row that fits, rows in creation order
    free = []
    for s in sorted(sizes.tolist(), reverse=True):
        fits = [i for i, f in enumerate(free) if f >= s]
        if fits:
            best = min(fits, key=lambda i: free[i])
            free[best] -= s
        else:
            free.append(cap - s)
    assert n_rows == len(free)
    loads = np.bincount(row_of, weights=sizes, minlength=n_rows)
    assert sorted((cap - loads).tolist()) == sorted(free)


def test_deterministic_for_a_seed():
    lengths = lognormal_lengths(2000, 300, 1.0, 2048, seed=3)
    for s in STRATEGIES:
        a, b = pack(s, lengths, 2048, seed=5), pack(s, lengths, 2048, seed=5)
        assert np.array_equal(a.example, b.example) and np.array_equal(a.row_offsets, b.row_offsets)
    assert not np.array_equal(pack("padded", lengths, 2048, seed=5).example, pack("padded", lengths, 2048, seed=6).example)


def test_bfd_split_splits_instead_of_truncating():
    plan = pack("bfd_split", np.array([10, 25, 3]), 10)
    assert plan.split == 1 and plan.truncated == 0
    pieces = sorted(zip(plan.example.tolist(), plan.start.tolist(), plan.length.tolist()))
    assert pieces == [(0, 0, 10), (1, 0, 10), (1, 10, 10), (1, 20, 5), (2, 0, 3)]


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 8))
def test_rank_balance_within_one_row(lengths, world):
    plan = pack("bfd", lengths, 512)
    tokens = plan.row_tokens
    ranks = deal_to_ranks(tokens, world)
    assert sorted(np.concatenate(ranks).tolist()) == list(range(plan.num_rows))
    counts = [len(r) for r in ranks]
    assert max(counts) - min(counts) <= 1
    loads = [int(tokens[r].sum()) for r in ranks]
    assert max(loads) - min(loads) <= (tokens.max() if len(tokens) else 0)


def test_simulate_reference_figures():
    """The issue's reference: 20k lognormal(median 450, sigma 0.9) lengths capped at 4096."""
    s = plan_summary(lognormal_lengths(20000, 450, 0.9, 4096, seed=0), None, 4096, batch_size=8, window=512)
    st_ = s["strategies"]
    assert st_["padded"]["real_token_share"] == pytest.approx(0.368, abs=0.01)
    assert st_["padded"]["attention_work_ratio"] == pytest.approx(4.70, abs=0.2)
    assert st_["sorted"]["real_token_share"] == pytest.approx(0.960, abs=0.01)
    assert st_["bfd"]["real_token_share"] > 0.999
    assert st_["bfd"]["rows"] == pytest.approx(3250, rel=0.02)
    assert s["tokens"] == pytest.approx(13.3e6, rel=0.02)
    assert st_["bfd"]["attention_work_ratio"] == pytest.approx(1.0)


def test_recommended_max_length():
    assert recommend_max_length(np.arange(1, 1001)) == 1024  # p99 = 990 -> next multiple of 64 above
    assert recommend_max_length(np.full(100, 1500)) == 1536  # multiples of 128 past 1024
    assert recommend_max_length(np.full(100, 512)) == 576  # strictly above p99
