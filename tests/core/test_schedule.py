"""Plans (core.schedule): Algorithm 2 order, the K window, state-aware 1F1B, determinism."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.core.schedule import megatron_1f1b_plan, state_aware_plan
from megatron_chunkflow.core.simulate import simulate
from megatron_chunkflow.core.step import plan_chunkflow
from megatron_chunkflow.core.types import Op
from tests.core.plan_checks import check_plan

TINY = get_model_shape("tiny")


def plan_for(lengths, C, k, p, dp=1, rank=0, shape=TINY):
    batch = build_chunks(lengths, C, dp, k, shape)
    chunks = batch.chunks_for_rank(rank)
    costs = OpCosts.from_model(chunks, shape, p)
    return state_aware_plan(chunks, p, k, costs), costs


def test_algorithm_2_pp1():
    """One sequence of 5 chunks, K=2: F0..F4 (F0-F2 without graph), B4 B3, R2 B2, R1 B1, R0 B0."""
    plan, _ = plan_for([5 * 10], 10, k=2, p=1)
    assert plan.stages[0] == tuple(Op(*x) for x in [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("F", 4), ("B", 4), ("B", 3),
        ("R", 2), ("B", 2), ("R", 1), ("B", 1), ("R", 0), ("B", 0)])


def test_k_at_least_n_keeps_everything():
    plan, _ = plan_for([35], 10, k=4, p=1)
    assert [op.kind for op in plan.stages[0]] == ["F"] * 4 + ["B"] * 4
    assert plan.recomputed == frozenset()


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(1, 40), st.integers(41, 400)),
                     min_size=1, max_size=30),
    chunk_size=st.integers(8, 64), k=st.integers(1, 4), p=st.integers(1, 5),
)
def test_plan_properties(lengths, chunk_size, k, p):
    plan, costs = plan_for(lengths, chunk_size, k, p)
    check_plan(plan, k)
    sim = simulate(plan, costs)  # replays without deadlock
    for s, peak in enumerate(sim.peak_held):
        assert peak <= max(p - s, k)


def test_fewer_chunks_than_stages():
    plan, costs = plan_for([5, 7], 16, k=1, p=4)
    check_plan(plan, 1)
    assert len(plan.chunks) == 1 and simulate(plan, costs).step_time > 0


def test_standalone_only_is_megatron_1f1b():
    chunks = build_chunks([10] * 9, 10, 1, 1, TINY).chunks
    for p in (1, 2, 3, 4):
        costs = OpCosts.uniform([c.id for c in chunks], p)
        assert state_aware_plan(chunks, p, 1, costs).stages == megatron_1f1b_plan(chunks, p).stages


def test_rebuild_per_rank_is_identical():
    """Each DP rank rebuilds the step from (seed, step) alone and gets the same plan."""
    shape = get_model_shape("qwen2.5-7b")
    full_batch, full = plan_chunkflow(sample_lengths("B", 3000, 1, step=5), 8192, 2, 4, 4, shape)
    for rank in range(4):
        batch, again = plan_chunkflow(sample_lengths("B", 3000, 1, step=5), 8192, 2, 4, 4, shape)
        assert batch == full_batch
        assert again.plans[rank] == full.plans[rank]
        check_plan(again.plans[rank], 2)


@pytest.mark.parametrize("bad,match", [({"num_stages": 0}, "pipeline"),
                                       ({"num_kept": 0}, "K must")])
def test_bad_settings(bad, match):
    chunks = build_chunks([10], 10, 1, 1, TINY).chunks
    args = {"num_stages": 2, "num_kept": 1, **bad}
    with pytest.raises(ValueError, match=match):
        state_aware_plan(chunks, costs=OpCosts.uniform([0], 2), **args)
