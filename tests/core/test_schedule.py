"""Plans (core.schedule): Algorithm 2 order, the K window, state-aware 1F1B, determinism."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.core.schedule import (
    megatron_1f1b_plan,
    megatron_interleaved_plan,
    state_aware_plan,
)
from megatron_chunkflow.core.simulate import simulate
from megatron_chunkflow.core.step import plan_chunkflow
from megatron_chunkflow.core.types import Op
from tests.core.plan_checks import check_plan

TINY = get_model_shape("tiny")


def plan_for(lengths, C, k, p, dp=1, rank=0, shape=TINY, v=1):
    batch = build_chunks(lengths, C, dp, k, shape)
    chunks = batch.chunks_for_rank(rank)
    costs = OpCosts.from_model(chunks, shape, p * v)
    return state_aware_plan(chunks, p, k, costs, v), costs


def test_algorithm_2_pp1():
    """One sequence of 5 chunks, K=2: F0..F4 (F0-F2 without graph), B4 B3, R2 B2, R1 B1, R0 B0."""
    plan, _ = plan_for([5 * 10], 10, k=2, p=1)
    assert plan.stages[0] == tuple(Op(*x) for x in [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("F", 4), ("B", 4), ("B", 3),
        ("R", 2), ("B", 2), ("R", 1), ("B", 1), ("R", 0), ("B", 0)])


def test_pp1_ends_with_the_costliest_backward():
    """Without a pipeline the step's last op is a standalone chunk's B, behind which DP's gradient
    reduce-scatter runs: the one with the costliest backward goes last (the others in order)."""
    plan, costs = plan_for([50, 3, 9, 10, 2, 8], 10, k=1, p=1)
    standalone = [c for c in plan.chunks if not c.is_dependent]
    costliest = max(standalone, key=lambda c: costs("B", c.id, 0))
    assert costliest is not standalone[-1]
    ops = plan.stages[0]
    assert ops[-1] == Op("B", costliest.id) and ops[-2] == Op("F", costliest.id)
    others = [op.chunk for op in ops if op.kind == "F" and op.chunk != costliest.id
              and not plan.chunks[op.chunk].is_dependent]
    assert others == [c.id for c in standalone if c is not costliest]
    piped, _ = plan_for([50, 3, 9, 10, 2, 8], 10, k=1, p=2)  # a pipeline keeps its order
    assert piped.stages[-1][-1] != Op("B", costliest.id)


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


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(1, 40), st.integers(41, 400)),
                     min_size=1, max_size=30),
    chunk_size=st.integers(8, 64), k=st.integers(1, 4), p=st.integers(2, 8), v=st.integers(2, 3),
    noise=st.one_of(st.none(), st.integers(0, 2**16)),
)
def test_interleaved_plan_properties(lengths, chunk_size, k, p, v, noise):
    """Random long-tailed batches on PP x V virtual stages, with the model's costs or random ones
    (any micro-batch count, also those Megatron's interleaved schedule refuses): the plan keeps
    every rule per virtual stage, at most K dependent chunks of a sequence per model chunk and
    K x V per rank hold activations, and it replays without deadlock."""
    plan, costs = plan_for(lengths, chunk_size, k, p, v=v)
    if noise is not None:
        rng = random.Random(noise)
        costs = OpCosts({c: [f * rng.uniform(0.1, 3) for f in row]
                         for c, row in costs.forward.items()})
        plan = state_aware_plan(plan.chunks, p, k, costs, v)
    assert plan.num_model_chunks == v
    check_plan(plan, k)
    simulate(plan, costs)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (4, 4, 32),
                                   (8, 2, 32)])
def test_standalone_only_interleaved_matches_megatron(p, v, m):
    """Equal standalone chunks: the interleaved plan takes Megatron's interleaved 1F1B step time,
    and holds at most one model chunk's activations more on any rank."""
    chunks = build_chunks([10] * m, 10, 1, 1, TINY).chunks
    costs = OpCosts.uniform([c.id for c in chunks], p * v, forward=1.0 / v)
    ours = simulate(state_aware_plan(chunks, p, 1, costs, v), costs)
    megatron = simulate(megatron_interleaved_plan(chunks, p, v), costs)
    flat = simulate(megatron_1f1b_plan(chunks, p), OpCosts.uniform([c.id for c in chunks], p))
    assert ours.step_time == pytest.approx(megatron.step_time)
    assert max(ours.peak_held) <= max(megatron.peak_held) + 1
    assert megatron.bubble_ratio < flat.bubble_ratio


def test_interleaved_reforward_takes_the_slot_its_sibling_frees():
    """PP 8 x V 2, K 1: a sequence of 4 chunks (3 re-forwarded) and 9 standalone chunks, costs as
    the simulator gave qwen2.5-32b at 256K (attention growing along the sequence, a tiny last
    chunk). Model chunk 1 of rank 0 holds 8 chunks at most; when the sequence's kept chunk frees
    its slot there, R of its predecessor must take it before the next standalone forward, or the
    standalone chunks held behind the sequence's backward wait forever (the planner stalled)."""
    chunks = build_chunks([112] + [32] * 8 + [2], 32, 1, 1, TINY).chunks
    assert [c.is_dependent for c in chunks] == [True] * 4 + [False] * 9
    fwd = {0: 0.040, 1: 0.059, 2: 0.078, 3: 0.048, 12: 0.002}
    bwd = {0: 0.084, 1: 0.147, 2: 0.210, 3: 0.136, 12: 0.005}

    def costs(kind, chunk, stage):
        return (bwd.get(chunk, 0.057) if kind == "B" else fwd.get(chunk, 0.031))

    costs.comm = 0.0
    plan = state_aware_plan(chunks, 8, 1, costs, 2)
    check_plan(plan, 1)
    sim = simulate(plan, costs)
    for r, ops in enumerate(plan.stages):  # R(2) right after B(3) on every model chunk
        for v in (0, 1):
            mine = [op for op in ops if op.model_chunk == v]
            assert mine[mine.index(Op("B", 3, v)) + 1] == Op("R", 2, v), (r, v)
    assert sim.step_time > 0


def test_megatron_interleaved_order():
    """PP 2, V 2, 4 micro-batches: Megatron's table (groups of PP per model chunk), warmup
    2 (PP - r - 1) + (V - 1) PP, then 1F1B; backwards through model chunks V-1..0."""
    chunks = build_chunks([10] * 4, 10, 1, 1, TINY).chunks
    plan = megatron_interleaved_plan(chunks, 2, 2)
    text = [" ".join(f"{o.kind}{o.chunk}.{o.model_chunk}" for o in ops) for ops in plan.stages]
    assert text[0] == ("F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 "
                       "B2.1 B3.1 B2.0 B3.0")
    assert text[1] == ("F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 "
                       "F3.1 B3.1 B2.0 B3.0")
    with pytest.raises(ValueError, match="needs a multiple of 2"):
        megatron_interleaved_plan(build_chunks([10] * 5, 10, 1, 1, TINY).chunks, 2, 2)
    with pytest.raises(ValueError, match="at least 4"):
        megatron_interleaved_plan(chunks[:3], 4, 2)


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
                                       ({"num_kept": 0}, "K must"),
                                       ({"num_model_chunks": 0}, "virtual stages"),
                                       ({"num_stages": 1, "num_model_chunks": 2}, "virtual")])
def test_bad_settings(bad, match):
    chunks = build_chunks([10], 10, 1, 1, TINY).chunks
    args = {"num_stages": 2, "num_kept": 1, **bad}
    with pytest.raises(ValueError, match=match):
        state_aware_plan(chunks, costs=OpCosts.uniform([0], 2), **args)
