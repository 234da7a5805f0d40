"""scripts/benchmarks/cp_split_cost.py: the ring's cost on a plan's standalone chunks and the
smallest group of ranks a split segment fits, on a fixed small plan (no search)."""

import runpy
from pathlib import Path

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.predict import predict_chunkflow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts/benchmarks/cp_split_cost.py"), run_name="split")
SHAPE, HW = get_model_shape("qwen2.5-0.5b"), get_gpu("h100")


def costs(lengths, cp=4, placement="hybrid"):
    layout = ParallelConfig(tp=1, cp=cp, pp=1, dp=1)
    pred = predict_chunkflow(lengths, SHAPE, HW, layout, 16384, 1, cp_placement=placement)
    return SCRIPT["split_costs"](pred, lengths, SHAPE, HW)


def test_short_segments_held_whole_cost_no_ring():
    out = costs([512] * 32)  # one packed chunk, 8 sequences held whole per rank
    assert out["ranks"][0]["ring_s"] == 0.0 and out["ranks"][0]["segments"] == []


def test_a_segment_over_the_share_is_sized_to_the_smallest_group():
    out = costs([6000] + [500] * 20)  # one chunk of 16,000: a rank's share ~4,000
    rank = out["ranks"][0]
    assert rank["ring_s"] > 0  # the 6,000-token segment is ringed over the 4 ranks
    [seg] = rank["segments"]
    assert seg["tokens"] == 6000 and seg["share"] < 6000 <= 2 * seg["share"]
    assert seg["group"] == 2 and seg["added_s"] > 0  # its pairs over 2 ranks, not 4
    # split everywhere, each of the 21 segments is ringed: the ring costs more
    split = costs([6000] + [500] * 20, placement="split")["ranks"][0]
    assert split["ring_s"] > rank["ring_s"]


def test_a_segment_that_needs_every_rank():
    [seg] = costs([14000] + [500] * 4)["ranks"][0]["segments"]
    assert seg["group"] is None and seg["added_s"] is None  # 14,000 > 2 x a share of 4,000


def test_no_cp_is_refused():
    with pytest.raises(ValueError, match="no CP"):
        costs([512] * 4, cp=1)
