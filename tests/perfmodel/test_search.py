"""Layout and (chunk size, K) searches (perfmodel/search.py): the pruned search finds exactly what
an exhaustive one finds, because both floors are lower bounds."""

import pytest

from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.perfmodel.footprint import chunkflow_memory_floor, megatron_memory_floor
from megatron_chunkflow.perfmodel.hardware import get_gpu, with_overrides
from megatron_chunkflow.perfmodel.predict import (
    chunk_work_items,
    predict_chunkflow,
    predict_megatron,
    roofline,
    time_floor,
)
from megatron_chunkflow.perfmodel.search import (
    best_chunkflow,
    best_megatron,
    candidate_layouts,
    chunking_candidates,
)

SHAPE = get_model_shape("qwen2.5-1.5b")
HW = with_overrides(get_gpu("h100"), ["hbm_gb=40"])  # a budget that excludes some candidates
SEQ = 65536
LENGTHS = [min(n, SEQ) for n in sample_lengths("B", 400, seed=3)] + [60000]


def exhaustive(predictions):
    fitting = [p for p in predictions if p.fits]
    return min(fitting, key=lambda p: p.step_s)


def test_floors_bound_every_candidate():
    for lay in candidate_layouts(SHAPE, HW, 8, allow_cp=True)[::3]:
        p = predict_megatron(LENGTHS, SHAPE, HW, lay, SEQ)
        mbs = baseline_microbatches(LENGTHS, SEQ, lay.dp)
        floor = time_floor(chunk_work_items(mbs, HW.attn_block, lay.cp), roofline(SHAPE, lay, HW))
        assert floor <= p.step_s * (1 + 1e-9)
        floor = megatron_memory_floor(LENGTHS, SHAPE, lay, HW.dtype_bytes)
        assert floor <= p.peak_mem_bytes * (1 + 1e-9)
    for lay in candidate_layouts(SHAPE, HW, 8, allow_cp=False)[::2]:
        for c, k in chunking_candidates(LENGTHS, SEQ, lay.tp)[::3]:
            p = predict_chunkflow(LENGTHS, SHAPE, HW, lay, c, k)
            items = chunk_work_items(build_chunks(LENGTHS, c, lay.dp, k, SHAPE).chunks,
                                     HW.attn_block, 1, k)
            assert time_floor(items, roofline(SHAPE, lay, HW)) <= p.step_s * (1 + 1e-9)
            floor = chunkflow_memory_floor(LENGTHS, SHAPE, lay, HW.dtype_bytes, c, k)
            assert floor <= p.peak_mem_bytes * (1 + 1e-9)


def test_megatron_search_is_exact():
    layouts = candidate_layouts(SHAPE, HW, 8, allow_cp=True)
    brute = exhaustive([predict_megatron(LENGTHS, SHAPE, HW, lay, SEQ) for lay in layouts])
    found = best_megatron(LENGTHS, SHAPE, HW, 8, SEQ)
    assert found.fits and found.step_s == pytest.approx(brute.step_s, rel=1e-12)


def test_chunkflow_search_is_exact():
    layouts = candidate_layouts(SHAPE, HW, 8, allow_cp=False)
    brute = exhaustive([predict_chunkflow(LENGTHS, SHAPE, HW, lay, c, k) for lay in layouts
                        for c, k in chunking_candidates(LENGTHS, SEQ, lay.tp)])
    found = best_chunkflow(LENGTHS, SHAPE, HW, 8, SEQ, auto_chunking=True)
    assert found.fits and found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    assert found.layout.cp == 1


def test_nothing_fits_returns_the_smallest_footprint():
    tiny_hbm = with_overrides(HW, ["hbm_gb=4"])
    p = best_chunkflow(LENGTHS, SHAPE, tiny_hbm, 8, SEQ, auto_chunking=True)
    assert not p.fits and p.chunk_size == 2048
