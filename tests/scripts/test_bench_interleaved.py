"""scripts/benchmarks/bench_interleaved.py: its batch and its bubble arithmetic (the measured run
itself is the script's job; its numbers are in docs/benchmarks-appendix.md)."""

import runpy
from pathlib import Path

import pytest

from megatron_chunkflow.core.costs import OpCosts
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import interleaving_problem, state_aware_plan
from megatron_chunkflow.core.simulate import simulate
from megatron_chunkflow.core.step import baseline_microbatches

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts/benchmarks/bench_interleaved.py"),
                        run_name="bench_interleaved")


def test_batch_runs_on_both_schedules():
    """One sequence longer than the chunk size; stock megatron-sft's line count is one Megatron's
    interleaved schedule takes at PP 2."""
    lengths = SCRIPT["batch_lengths"]()
    assert sum(n > 512 for n in lengths) >= 1 and max(lengths) == 2048
    lines = baseline_microbatches(lengths, max(lengths), 1, "megatron-sft")
    assert interleaving_problem(len(lines), 2, 2) is None


@pytest.mark.parametrize("vpp", [1, 2])
def test_measured_and_replayed_bubble_of_a_known_timeline(vpp):
    """Rows built from a replay with known op times: the measured bubble (busy / span) and the
    replay of those op times both give the simulator's bubble back."""
    shape = get_model_shape("tiny-bench")
    chunks = build_chunks([2048, 300, 90, 500, 20, 700, 410], 512, 1, 1, shape).chunks
    costs = OpCosts.from_model(chunks, shape, 2 * vpp)
    plan = state_aware_plan(chunks, 2, 1, costs, vpp)
    sim = simulate(plan, costs, comm=0.0)
    rows = [[(sim.busy[r], sim.step_time, [t.end - t.start for t in sim.timeline[r]])
             for r in range(2)]]
    out = SCRIPT["_medians"](rows, plan)
    assert out["bubble"] == pytest.approx(sim.bubble_ratio)
    assert out["replayed_bubble"] == pytest.approx(sim.bubble_ratio)
    assert 0 < sim.bubble_ratio < 0.5
