"""Layout, recompute and (chunk size, K) searches (perfmodel/search.py): the pruned search finds
exactly what an exhaustive one over Megatron's whole recompute menu finds, because the floors
are lower bounds and the dominance rule holds op by op. A 4-layer model keeps the menu (12
options at PP 1) and brute force small."""

import pytest

from megatron_chunkflow.config import ParallelConfig, Recompute
from megatron_chunkflow.core.models import ModelShape, get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.core.step import BASELINES, baseline_microbatches
from megatron_chunkflow.perfmodel.floors import chunk_work_items, relaxed_1f1b_floor, time_floor
from megatron_chunkflow.perfmodel.hardware import get_gpu, with_overrides
from megatron_chunkflow.perfmodel.memfloors import (
    chunkflow_memory_floor,
    inflight_tokens,
    megatron_memory_floor,
)
from megatron_chunkflow.perfmodel.predict import (
    predict_chunkflow,
    predict_megatron,
    roofline,
)
from megatron_chunkflow.perfmodel.search import (
    best_chunkflow,
    best_megatron,
    candidate_layouts,
    chunking_candidates,
    recompute_dominates,
    unsupported_interleaving,
)

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

SHAPE = ModelShape(4, 2048, 5632, 16, 4, 32000)
SEQ = 32768
LENGTHS = [min(n, SEQ) for n in sample_lengths("B", 120, seed=3)] + [30000]
STOCK_HW = with_overrides(get_gpu("h100"), ["memory_gib=12.9"])  # none fits only with CP 2
CF_HW = with_overrides(get_gpu("h100"), ["memory_gib=8.9"])  # C = 16K fits only with recompute


def fastest_fitting(predictions):
    return min((p for p in predictions if p.fits), key=lambda p: p.step_s)


def test_candidates_are_megatrons_layouts_with_the_whole_menu():
    shape = get_model_shape("qwen2.5-7b")  # 28 layers: PP 8 does not divide them
    layouts = candidate_layouts(shape, get_gpu("h100"), 32, allow_cp=True)
    assert {lay.pp for lay in layouts} == {1, 2, 4}
    for pp in (1, 2, 4):
        menu = {lay.recompute for lay in layouts if (lay.tp, lay.cp, lay.pp) == (2, 2, pp)}
        assert menu == set(Recompute.menu(28 // pp))
    at_pp4 = {lay.recompute for lay in layouts if lay.pp == 4}
    assert Recompute("block", num_layers=6) in at_pp4  # block:7 of 7 layers is full
    assert Recompute("block", num_layers=7) not in at_pp4 and Recompute("full") in at_pp4


@pytest.mark.parametrize("baseline", BASELINES)
def test_floors_bound_every_stock_candidate(baseline):
    """Time floor <= refined floor <= step; the memory floor from the micro-batches in flight
    bounds the predicted peak, within its running op's working memory."""
    for lay in candidate_layouts(SHAPE, STOCK_HW, 2, allow_cp=True)[::3]:
        mbs = baseline_microbatches(LENGTHS, SEQ, lay.dp, baseline, lay.cp)
        if unsupported_interleaving(mbs, lay):
            continue
        p = predict_megatron(LENGTHS, SHAPE, STOCK_HW, lay, SEQ, baseline)
        model = roofline(SHAPE, lay, STOCK_HW)
        floor = time_floor(chunk_work_items(mbs, STOCK_HW.attn_block, lay.cp), model)
        ranks = [[c for c in mbs if c.dp_rank == r] for r in range(lay.dp)]
        sends = "fixed" if baseline == "megatron-sft" else "variable"
        refined = relaxed_1f1b_floor(ranks, model, model.stage_costs(
            mbs, lay.num_virtual_stages, SEQ, sends))
        assert floor <= p.step_s * (1 + 1e-9) and refined <= p.step_s * (1 + 1e-9)
        memory = megatron_memory_floor(LENGTHS, SHAPE, lay, STOCK_HW.dtype_bytes,
                                       inflight_tokens(mbs, lay.dp, lay.cp, lay.pp, lay.vpp))
        assert 0.8 * p.peak_mem_bytes <= memory <= p.peak_mem_bytes * (1 + 1e-9)  # V > 1 too
        loose = megatron_memory_floor(LENGTHS, SHAPE, lay, STOCK_HW.dtype_bytes)
        assert loose <= p.peak_mem_bytes * (1 + 1e-9)


def test_floors_bound_every_chunkflow_candidate():
    for lay in candidate_layouts(SHAPE, CF_HW, 2, allow_cp=False)[::2]:
        for c, k in chunking_candidates(LENGTHS, SEQ, lay.tp)[::3]:
            p = predict_chunkflow(LENGTHS, SHAPE, CF_HW, lay, c, k)
            items = chunk_work_items(build_chunks(LENGTHS, c, lay.dp, k, SHAPE).chunks,
                                     CF_HW.attn_block, 1, k)
            assert time_floor(items, roofline(SHAPE, lay, CF_HW)) <= p.step_s * (1 + 1e-9)
            floor = chunkflow_memory_floor(LENGTHS, SHAPE, lay, CF_HW.dtype_bytes, c, k)
            assert floor <= p.peak_mem_bytes * (1 + 1e-9)


def test_dominance_holds_op_by_op():
    """recompute_dominates(a, b): every op under b costs at least what it costs under a, which
    is what lets the stock search skip b once a fits or is ruled out."""
    chunks = baseline_microbatches(LENGTHS, SEQ, 1, "megatron-packed")
    menu = Recompute.menu(2)
    for a in menu:
        for b in menu:
            if not recompute_dominates(a, b):
                continue
            ca, cb = (roofline(SHAPE, P(tp=2, pp=2, recompute=rc), STOCK_HW)
                      .stage_costs(chunks, 2, SEQ, "variable") for rc in (a, b))
            for c in chunks:
                for s in range(2):
                    assert ca("F", c.id, s) == cb("F", c.id, s)
                    assert ca("B", c.id, s) <= cb("B", c.id, s)
    assert recompute_dominates(Recompute("block", num_layers=1), Recompute("full"))
    assert not recompute_dominates(Recompute("block", num_layers=1),
                                   Recompute("selective", ("core_attn",)))


def stock_brute_and_found(hw, baseline):
    """(brute force over every layout Megatron runs, the pruned search) of one baseline."""
    layouts = [lay for lay in candidate_layouts(SHAPE, hw, 2, allow_cp=True)
               if not unsupported_interleaving(
                   baseline_microbatches(LENGTHS, SEQ, lay.dp, baseline, lay.cp), lay)]
    brute = fastest_fitting(predict_megatron(LENGTHS, SHAPE, hw, lay, SEQ, baseline)
                            for lay in layouts)
    return brute, best_megatron(LENGTHS, SHAPE, hw, 2, SEQ, baseline=baseline)


def chunkflow_auto_brute_and_found(hw):
    """(brute force over every (C, K), the pruned --auto search) at TP 2, selective:mlp."""
    lay = P(tp=2, recompute="selective:mlp")
    brute = fastest_fitting(predict_chunkflow(LENGTHS, SHAPE, hw, lay, c, k)
                            for c, k in chunking_candidates(LENGTHS, SEQ, 2))
    return brute, best_chunkflow(LENGTHS, SHAPE, hw, 2, SEQ, layout=lay, auto_chunking=True)


@pytest.mark.parametrize("baseline", BASELINES)
def test_megatron_search_is_exact(baseline):
    brute, found = stock_brute_and_found(STOCK_HW, baseline)
    assert found.fits and found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    assert found.baseline == baseline


def test_megatron_search_picks_from_the_menu():
    """On this budget the fastest fitting stock layout needs a recompute option that is
    neither none nor full."""
    found = best_megatron(LENGTHS, SHAPE, STOCK_HW, 2, SEQ)
    assert found.layout.recompute.kind in ("selective", "block")


def test_chunkflow_search_is_exact():
    layouts = candidate_layouts(SHAPE, CF_HW, 2, allow_cp=True)
    brute = fastest_fitting(predict_chunkflow(LENGTHS, SHAPE, CF_HW, lay, 16384, 1)
                            for lay in layouts)
    found = best_chunkflow(LENGTHS, SHAPE, CF_HW, 2, SEQ, chunk_size=16384, num_kept=1)
    assert found.fits and found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    assert found.layout.cp == 1 and found.layout.recompute.kind != "none"


def test_chunkflow_auto_search_is_exact():
    brute, found = chunkflow_auto_brute_and_found(CF_HW)
    assert found.step_s == pytest.approx(brute.step_s, rel=1e-12)


def test_nothing_fits_returns_the_smallest_footprint():
    tiny_hbm = with_overrides(CF_HW, ["memory_gib=4.0"])
    p = best_chunkflow(LENGTHS, SHAPE, tiny_hbm, 2, SEQ, chunk_size=2048)
    assert not p.fits and p.layout.recompute == Recompute("full")


@pytest.mark.parametrize("baseline", BASELINES)
def test_searches_are_exact_on_the_calibrated_local_build(baseline):
    """The H200 profile's clock (megatron-core's local layer, its launch floor and per-chunk
    gradient accumulation): the pruned searches still find what brute force finds."""
    from megatron_chunkflow.perfmodel.gpu_profiles import load_profile

    local = load_profile("h200-torch2.11-local")
    stock_hw, cf_hw = (with_overrides(local, [f"memory_gib={m}"]) for m in (14.9, 8.9))
    brute, found = stock_brute_and_found(stock_hw, baseline)
    assert found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    if baseline == "megatron-packed":
        brute, found = chunkflow_auto_brute_and_found(cf_hw)
        assert found.step_s == pytest.approx(brute.step_s, rel=1e-12)
