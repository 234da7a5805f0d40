"""The plan simulator (core.simulate)."""

from fractions import Fraction

import pytest

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import megatron_1f1b_plan, state_aware_plan
from megatron_chunkflow.core.simulate import PlanDeadlock, simulate
from megatron_chunkflow.core.types import Op, PipelinePlan

TINY = get_model_shape("tiny")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_1f1b_bubble_is_exact(p, m):
    """m equal micro-batches on p stages: bubble = (p-1)/(m+p-1), for both planners."""
    chunks = build_chunks([10] * m, 10, 1, 1, TINY).chunks
    costs = OpCosts.uniform([c.id for c in chunks], p, forward=1.0, backward_factor=2.0)
    expected = Fraction(p - 1, m + p - 1)
    for plan in (megatron_1f1b_plan(chunks, p), state_aware_plan(chunks, p, 1, costs)):
        sim = simulate(plan, costs)
        assert sim.bubble_ratio == pytest.approx(float(expected), abs=1e-12)
        assert sim.step_time == pytest.approx(3.0 * (m + p - 1))
        assert sim.peak_held == tuple(min(p - s, m) for s in range(p))


def test_recompute_and_busy_time():
    chunks = build_chunks([40], 10, 1, 1, TINY).chunks  # 4 dependent chunks
    costs = OpCosts.uniform([c.id for c in chunks], 1)
    sim = simulate(state_aware_plan(chunks, 1, 1, costs), costs)
    assert sim.num_recompute == 3
    assert sim.busy == (4 * 1 + 3 * 1 + 4 * 2,)  # 4 F, 3 R, 4 B
    assert sim.bubble_ratio == 0.0


def test_comm_latency_delays_cross_stage_ops():
    chunks = build_chunks([10], 10, 1, 1, TINY).chunks
    costs = OpCosts.uniform([0], 2, comm=0.5)
    assert simulate(megatron_1f1b_plan(chunks, 2), costs).step_time == pytest.approx(6 + 2 * 0.5)


def test_deadlock_is_reported():
    chunks = build_chunks([10], 10, 1, 1, TINY).chunks
    plan = PipelinePlan(((Op("B", 0), Op("F", 0)), (Op("F", 0), Op("B", 0))), chunks)
    with pytest.raises(PlanDeadlock, match="deadlock"):
        simulate(plan, OpCosts.uniform([0], 2))
