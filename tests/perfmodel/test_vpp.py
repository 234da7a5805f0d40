"""Virtual pipeline stages (ParallelConfig.vpp) in the performance model and the searches, for
both systems: Megatron's interleaved 1F1B shrinks the bubble and costs activation memory on the
first rank by about (1 + (p - 1) / (p V)) (Narayanan et al. 2021, Megatron's interleaving), the
sends grow V times, the searches take V and skip what Megatron refuses."""

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import ModelShape, get_model_shape
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.perfmodel.floors import chunk_work_items, relaxed_1f1b_floor, time_floor
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.memfloors import inflight_tokens, megatron_memory_floor
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron, roofline
from megatron_chunkflow.perfmodel.search import (
    MAX_VPP,
    best_chunkflow,
    best_megatron,
    candidate_layouts,
    unsupported_interleaving,
)

P = ParallelConfig.layout
Q32B = get_model_shape("qwen2.5-32b")  # 64 layers: PP 4 x V 1, 2, 4 all even
H100 = get_gpu("h100")
EIGHT = [8192] * 8  # 8 equal micro-batches: few for PP 4, a large bubble


def test_interleaving_shrinks_the_stock_bubble_and_step():
    one, two = (predict_megatron(EIGHT, Q32B, H100, P(tp=8, pp=4, vpp=v), 8192)
                for v in (1, 2))
    # Megatron's 1F1B: (p - 1) / (m + p - 1) = 3 / 11 with equal stages (the last one's output
    # layer and loss make it longer, the others wait: a little more); interleaved about
    # (p - 1) / V of it
    assert 3 / 11 - 0.01 < one.bubble < 3 / 11 + 0.04
    assert two.bubble < one.bubble - 0.05 and two.step_s < one.step_s
    assert two.layout.vpp == 2 and two.to_json()["layout"]["vpp"] == 2


def test_interleaving_costs_memory_on_the_first_rank():
    """Rank 0 holds 2 (p - 1) + (V - 1) p + 1 forwards of 1 / (p V) of the layers at its peak
    against p forwards of 1 / p: the factor 1 + (p - 1) / (p V) (exact here: the micro-batches
    are equal and the first rank has no output layer)."""
    m = 16  # enough micro-batches for every warmup
    acts = {v: predict_megatron([8192] * m, Q32B, H100, P(tp=8, pp=4, vpp=v), 8192)
            for v in (1, 2, 4)}
    held = {v: p.memory["activations"] for v, p in acts.items()}  # at the peak: the first rank
    for v in (2, 4):
        assert held[v] / held[1] == pytest.approx(1 + 3 / (4 * v), rel=0.02)
        assert acts[v].peak_mem_bytes > acts[1].peak_mem_bytes


def test_interleaving_multiplies_the_sends():
    """Every chunk crosses PP x V - 1 stage boundaries: V - 1 more sends per rank, each as long
    (the virtual stages' layers are 1/V of a rank's)."""
    model1, model2 = (roofline(Q32B, P(tp=8, pp=4, vpp=v), H100) for v in (1, 2))
    chunks = baseline_microbatches(EIGHT, 8192, 1)
    c1 = model1.stage_costs(chunks, 4, 8192, "fixed")
    c2 = model2.stage_costs(chunks, 8, 8192, "fixed")
    assert c1.send == c2.send  # the same message, charged at 7 boundaries instead of 3
    fwd1 = sum(c1("F", 0, s) for s in range(4))
    fwd2 = sum(c2("F", 0, s) for s in range(8))
    assert fwd2 == pytest.approx(fwd1 + 4 * c1.send[0], rel=1e-9)


def test_chunkflow_interleaved_prediction():
    long = [65536] + [2048] * 30
    one, two = (predict_chunkflow(long, Q32B, H100, P(tp=8, pp=4, vpp=v), 8192, 2)
                for v in (1, 2))
    assert two.layout.vpp == 2 and two.num_microbatches == one.num_microbatches
    assert two.bubble < one.bubble and two.step_s < one.step_s


def test_refused_micro_batch_counts():
    """Megatron's interleaved schedule wants a multiple of PP (a last group of at least PP);
    the prediction refuses, the search skips; ChunkFlow's plan takes any count."""
    lay = P(tp=8, pp=4, vpp=2)
    five = [8192] * 5
    assert "5 micro-batches per pipeline" in unsupported_interleaving(
        baseline_microbatches(five, 8192, 1), lay)
    assert unsupported_interleaving(baseline_microbatches(EIGHT, 8192, 1), lay) is None
    with pytest.raises(ValueError, match="micro-batches per pipeline"):
        predict_megatron(five, Q32B, H100, lay, 8192)
    assert predict_chunkflow(five, Q32B, H100, lay, 8192, 1).step_s > 0


def test_candidates_take_v_only_with_a_pipeline():
    layouts = candidate_layouts(Q32B, H100, 64, allow_cp=False)
    vs = {(lay.pp, lay.vpp) for lay in layouts}
    assert (1, 1) in vs and all(v == 1 for pp, v in vs if pp == 1)
    assert {(2, 2), (4, 2), (8, 2), (16, 2)} <= vs and max(v for _, v in vs) == MAX_VPP == 2
    assert {(4, 4), (8, 4)} <= {(lay.pp, lay.vpp) for lay in candidate_layouts(
        Q32B, H100, 64, allow_cp=False, max_vpp=4)}
    assert all(lay.recompute.num_layers <= 64 // lay.num_virtual_stages
               for lay in layouts if lay.recompute.kind == "block")


SMALL = ModelShape(8, 2048, 5632, 16, 4, 32000)  # 8 layers: V 2 at PP 2


def test_floors_bound_interleaved_candidates():
    lengths = [12000, 9000, 7000, 6000, 5000, 4000, 3000, 2500]
    for lay in candidate_layouts(SMALL, H100, 2, allow_cp=False):
        if lay.vpp == 1 or lay.recompute.kind not in ("none", "full"):
            continue
        mbs = baseline_microbatches(lengths, 16384, lay.dp)
        assert unsupported_interleaving(mbs, lay) is None
        p = predict_megatron(lengths, SMALL, H100, lay, 16384)
        model = roofline(SMALL, lay, H100)
        assert time_floor(chunk_work_items(mbs, H100.attn_block), model) <= p.step_s
        costs = model.stage_costs(mbs, lay.num_virtual_stages, 16384, "variable")
        assert relaxed_1f1b_floor([mbs], model, costs) <= p.step_s * (1 + 1e-9)
        memory = megatron_memory_floor(lengths, SMALL, lay, H100.dtype_bytes,
                                       inflight_tokens(mbs, 1, 1, lay.pp, lay.vpp))
        assert 0.8 * p.peak_mem_bytes <= memory <= p.peak_mem_bytes * (1 + 1e-9)


def test_searches_pick_interleaving_where_the_bubble_dominates():
    """Few micro-batches (16 x 8K on 16 GPUs) on a model that needs a pipeline to fit: both
    systems interleave where interleaving's extra activations fit (on an H200; an H100 leaves
    ChunkFlow's interleaved plan 3 GiB short)."""
    h200 = get_gpu("h200")
    stock = best_megatron(EIGHT * 2, Q32B, h200, 16, 8192, baseline="megatron-packed")
    cf = best_chunkflow(EIGHT * 2, Q32B, h200, 16, 8192, chunk_size=8192)
    assert stock.fits and cf.fits
    assert stock.layout.vpp > 1 and cf.layout.vpp > 1


def test_layout_text_takes_virtual_stages():
    lay = ParallelConfig.parse("4,1,4x2,full", 64, Q32B, "--flag")
    assert (lay.pp, lay.vpp, lay.dp, lay.num_virtual_stages) == (4, 2, 4, 8)
    assert lay.to_flag() == "4,1,4x2,full" and P(tp=4, pp=4, dp=4).to_flag() == "4,1,4,none"
    assert ParallelConfig.parse(lay.to_flag(), 64, Q32B, "--flag") == lay
    for text, message in (("4,1,4x0,none", "--flag 4,1,4x0,none: V must be >= 1, got 0"),
                          ("4,1,1x2,none", "--flag 4,1,1x2,none: V 2 virtual stages per pipeline"
                                           " rank need PP >= 2, got PP 1"),
                          ("4,1,4x3,none", "VPP 3 must divide the model's 16 layers per"),
                          ("4,1,4x,none", "PP optionally PPxV")):
        with pytest.raises(ValueError) as e:
            ParallelConfig.parse(text, 64, Q32B, "--flag")
        assert message in str(e.value)
