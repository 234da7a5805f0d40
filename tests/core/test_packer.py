"""Chunk construction and DP distribution (core.packer): properties on long-tailed inputs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import best_fit_decreasing, build_chunks, unit_cost
from megatron_chunkflow.core.profiles import sample_lengths
from tests.core.plan_checks import check_batch

Q7B = get_model_shape("qwen2.5-7b")  # the shape build_chunks once fell back to

# long-tailed: mostly short, sometimes far longer than the chunk size
lengths_st = st.lists(
    st.one_of(st.integers(1, 300), st.integers(1, 300), st.integers(1, 300),
              st.integers(300, 5000)),
    min_size=1, max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, chunk_size=st.integers(1, 700), dp=st.integers(1, 4),
       k=st.integers(1, 4))
def test_every_token_in_exactly_one_chunk(lengths, chunk_size, dp, k):
    batch = build_chunks(lengths, chunk_size, dp, k, get_model_shape("tiny"))
    check_batch(batch)
    # any-fit packing: at most one standalone chunk is half empty or less
    assert batch.num_standalone <= max(2 * batch.bins_lower_bound, 0)
    short_tokens = sum(n for n in lengths if n <= chunk_size)
    assert batch.bins_lower_bound == math.ceil(short_tokens / chunk_size)


@pytest.mark.parametrize("profile", ["A", "B", "C", "dcp"])
@pytest.mark.parametrize("num_sequences,chunk_size", [(200, 4096), (2000, 8192), (5000, 32768)])
def test_standalone_count_near_lower_bound(profile, num_sequences, chunk_size):
    """With chunks >= 4K (5x the median length), BFD lands on the bound or one above it."""
    for seed in range(3):
        batch = build_chunks(sample_lengths(profile, num_sequences, seed), chunk_size, 1, 1, Q7B)
        assert batch.num_standalone <= batch.bins_lower_bound + 1


def test_bfd_is_best_fit():
    # 6 goes to the bin with 4 free (fullest fit), not the one with 7 free
    bins = best_fit_decreasing([6, 3, 4, 2], [0, 1, 2, 3], capacity=10)
    assert bins == [[0, 2], [1, 3]]


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, dp=st.integers(2, 5))
def test_dp_balance_within_lpt_bound(lengths, dp):
    """Longest-processing-time first: no rank exceeds the mean load by more than the largest
    unit."""
    shape = get_model_shape("tiny")
    batch = build_chunks(lengths, 256, dp, 1, shape)
    units = {}
    for c in batch.chunks:
        units.setdefault(c.parent if c.is_dependent else ("s", c.id), []).append(c)
    loads = [0.0] * dp
    for u in units.values():
        loads[u[0].dp_rank] += unit_cost(u, shape, 1)
    largest = max(unit_cost(u, shape, 1) for u in units.values())
    assert max(loads) <= sum(loads) / dp + largest + 1e-6 * max(loads)


def test_attention_cost_counts_prefix():
    """A late dependent chunk costs more than an early one of the same size (C*prefix term)."""
    batch = build_chunks([4 * 8192], 8192, 1, 1, Q7B)
    costs = [unit_cost([c], Q7B, num_kept=1) for c in batch.chunks]
    assert costs == sorted(costs) and costs[-1] > costs[0] * 1.2


def test_deterministic():
    lengths = sample_lengths("B", 3000, seed=7, step=3)
    assert lengths == sample_lengths("B", 3000, seed=7, step=3)
    assert lengths != sample_lengths("B", 3000, seed=7, step=4)
    assert build_chunks(lengths, 8192, 4, 1, Q7B) == build_chunks(list(lengths), 8192, 4, 1, Q7B)


@pytest.mark.parametrize("bad,match", [
    ([], "empty"), ([5, 0, 3], "sequence 1 has length 0"), ([5, -2], "length -2"),
])
def test_bad_lengths(bad, match):
    with pytest.raises(ValueError, match=match):
        build_chunks(bad, 16, 1, 1, Q7B)


@pytest.mark.parametrize("kw,match", [({"chunk_size": 0}, "chunk size"),
                                      ({"num_kept": 0}, "K must"),
                                      ({"num_dp_ranks": 0}, "data-parallel")])
def test_bad_settings(kw, match):
    args = {"chunk_size": 16, "num_dp_ranks": 1, "num_kept": 1, "shape": Q7B, **kw}
    with pytest.raises(ValueError, match=match):
        build_chunks([10, 20], **args)


def test_shape_is_required():
    """The DP balance weighs units by a model's FLOPs: no silent default model."""
    with pytest.raises(TypeError, match="shape"):
        build_chunks([10, 20], 16, 1, 1)


def test_edge_lengths():
    """1 token, exactly C, exactly kC, kC + 1."""
    C = 64
    batch = build_chunks([1, C, 3 * C, 3 * C + 1], C, 1, 1, Q7B)
    check_batch(batch)
    dep = {}
    for c in batch.chunks:
        if c.is_dependent:
            dep.setdefault(c.parent, []).append(c.num_tokens)
    assert dep == {2: [C, C, C], 3: [C, C, C, 1]}
