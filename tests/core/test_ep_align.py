"""Plans in step for an expert group over DP ranks (core/ep_align.py): every rank of the group
runs the same op kinds in the same order on every stage, its own chunks keep and re-forward as
in its own plan, and the fillers carry no token."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_chunkflow.core.ep_align import aligned_plan
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.types import PipelinePlan
from tests.core.plan_checks import check_plan
from tests.core.test_schedule import plan_for

MOE = get_model_shape("tiny-qwen3-moe")


def _kinds(plan):
    return [[op.kind for op in ops] for ops in plan.stages]


def _own_part(plan, real):
    """The plan's ops on the rank's own chunks (the fillers' left out): a plan of its own."""
    return PipelinePlan(tuple(tuple(op for op in ops if op.chunk in real) for ops in plan.stages),
                        tuple(c for c in plan.chunks if c.id in real), plan.num_model_chunks)


def _fillers_run_whole(plan, real):
    """Each filler runs F and B (or F, R, B in a re-forwarded slot) on every virtual stage."""
    for r, ops in enumerate(plan.stages):
        kinds = {}
        for op in ops:
            if op.chunk not in real:
                kinds.setdefault((op.chunk, op.model_chunk), []).append(op.kind)
        assert all(k in (["F", "B"], ["F", "R", "B"]) for k in kinds.values()), kinds


def _aligned(lengths, C, k, p, dp, group, v=1):
    batch = build_chunks(lengths, C, dp, k, MOE)
    return batch, {r: aligned_plan(batch, group, r, p, k, MOE, v, filler_tokens=4)[0]
                   for r in group}


@pytest.mark.parametrize("lengths, k, p, v", [
    ([70, 6, 34, 100, 12, 64, 2, 16, 48, 10], 1, 1, 1),  # the MoE tests' batch over DP 2
    ([70, 6, 34, 100, 12, 64, 2, 16, 48, 10], 2, 2, 1),
    ([300, 5, 9, 40, 33, 7], 1, 2, 2),  # one rank holds the long sequence, virtual stages
])
def test_ranks_of_the_group_run_the_same_ops(lengths, k, p, v):
    batch, plans = _aligned(lengths, 32, k, p, 2, (0, 1), v)
    own = [plan_for(lengths, 32, k, p, dp=2, rank=r, shape=MOE, v=v)[0] for r in (0, 1)]
    assert _kinds(own[0]) != _kinds(own[1])  # the control: their own plans differ
    assert _kinds(plans[0]) == _kinds(plans[1])
    assert [[op.model_chunk for op in s] for s in plans[0].stages] == \
        [[op.model_chunk for op in s] for s in plans[1].stages]
    for r, plan in plans.items():
        real = {c.id for c in batch.chunks_for_rank(r)}
        check_plan(_own_part(plan, real), k)
        _fillers_run_whole(plan, real)
        fillers = [c for c in plan.chunks if c.id not in real]
        assert {c.id for c in plan.chunks} >= real  # every own chunk runs, once
        assert len({c.id for c in plan.chunks}) == len(plan.chunks)
        assert all(c.num_tokens == 0 and c.computed_tokens == 4 and not c.is_dependent
                   for c in fillers)
        # its own chunks keep activations or are re-forwarded exactly as in its own plan
        assert plan.recomputed & real == own[r].recomputed


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=14), st.integers(1, 3),
       st.integers(1, 3), st.integers(2, 3))
def test_any_batch_aligns(lengths, k, p, dp):
    group = tuple(range(dp))
    batch, plans = _aligned(lengths, 32, k, p, dp, group)
    kinds = {str(_kinds(plan)) for plan in plans.values()}
    assert len(kinds) == 1
    for r, plan in plans.items():
        real = {c.id for c in batch.chunks_for_rank(r)}
        assert real <= {c.id for c in plan.chunks}
        if real:  # (a rank without chunks of its own runs fillers only)
            check_plan(_own_part(plan, real), k)
        _fillers_run_whole(plan, real)


def test_a_rank_outside_the_group_is_refused():
    batch = build_chunks([40, 5], 32, 2, 1, MOE)
    with pytest.raises(ValueError, match="DP rank 3 is not among its expert group's"):
        aligned_plan(batch, (0, 1), 3, 1, 1, MOE)
