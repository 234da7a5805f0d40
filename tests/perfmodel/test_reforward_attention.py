"""Re-forwards that skip attention in the cost and memory model (--chunkflow-reforward-attention;
perfmodel/layer.py Parts.skipped, roofline.kept_attention_costs, footprint.py), as
runtime/reforward.py runs them."""

import dataclasses

import pytest
import torch

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import ModelShape, get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.schedule import is_reforwarded
from megatron_chunkflow.perfmodel.floors import chunk_work_items, floor_sums, time_floor
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.layer import chunk_work
from megatron_chunkflow.perfmodel.predict import predict_chunkflow, roofline, runtime_layout
from megatron_chunkflow.perfmodel.search import REFORWARD, best_chunkflow, candidate_layouts

P = ParallelConfig.layout
H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
LENGTHS = [3000, 5000, 7000, 2000, 65536]


@pytest.mark.parametrize("layout", [P(tp=2), P(tp=2, cp=2), P(tp=2, pp=2)])
def test_a_kept_reforward_skips_the_attention_core(layout):
    """R of a re-forwarded chunk costs its forward less the attention core (under CP its K/V
    exchange too) per layer; offload adds the copy of the output and log-sum-exp to the host
    (F) and back (R); the other ops and chunks are unchanged."""
    model = roofline(Q7B, layout, H100)
    chunks = build_chunks(LENGTHS, 8192, 1, 1, Q7B, segment_multiple=layout.segment_multiple,
                          chunk_multiple=layout.chunk_padding).chunks
    gather = "sharded" if layout.cp > 1 else False
    costs = {m: model.stage_costs(chunks, layout.pp, 8192, "async", gather, "hybrid", (m, 1))
             for m in REFORWARD}
    heads, width = 28 // 2, 28 * 128 // 2
    for c in chunks:
        again = is_reforwarded(c, 1)
        assert again == (c.is_dependent and c.index < c.num_siblings - 1)
        work = chunk_work(c, H100.attn_block, layout.cp, gather, layout.pad_multiple)
        parts = model.layer.parts(work)
        layers = 28 // layout.pp
        for s in range(layout.pp):
            f, b = costs["recompute"]("F", c.id, s), costs["recompute"]("B", c.id, s)
            assert costs["recompute"]("R", c.id, s) == f
            assert costs["keep"]("F", c.id, s) == f and costs["keep"]("B", c.id, s) == b
            if not again:
                assert costs["keep"]("R", c.id, s) == costs["offload"]("R", c.id, s) == f
                continue
            saved = layers * parts.skipped
            assert parts.skipped > 0
            assert costs["keep"]("R", c.id, s) == pytest.approx(f - saved, rel=1e-12)
            copy = layers * work.tokens * (width * 2 + heads * 4) / (H100.host_gb_s * 1e9)
            assert parts.kept_bytes == work.tokens * (width * 2 + heads * 4)
            assert costs["offload"]("F", c.id, s) == pytest.approx(f + copy, rel=1e-12)
            assert costs["offload"]("R", c.id, s) == pytest.approx(f - saved + copy, rel=1e-12)
    if layout.cp > 1:  # the ring's forward exchange is part of what the re-forward skips
        dep = next(c for c in chunks if is_reforwarded(c, 1) and c.index > 2)
        work = chunk_work(dep, H100.attn_block, 2, "sharded", layout.pad_multiple)
        alone = model.layer.attention(work.tokens, work.pairs)[0]  # no CP traffic
        assert model.layer.parts(work).skipped > alone


def test_keep_costs_memory_offload_costs_copies():
    """keep holds each re-forwarded chunk's attention output and log-sum-exp per layer: the
    state grows by (n - K) C x layers x heads x (head dim x 2 + 4) / TP bytes; offload holds it
    in host memory (no device bytes) and pays the copies; both are faster than recomputing it
    at 64K, where a chunk's attention over its prefix outweighs the copies."""
    layout = P(tp=2)
    pred = {m: predict_chunkflow(LENGTHS, Q7B, H100, layout, 8192, 1, reforward=m)
            for m in REFORWARD}
    n = 65536 // 8192
    kept = (n - 1) * 8192 * 28 * 14 * (128 * 2 + 4)
    assert pred["keep"].memory["kv_state"] - pred["recompute"].memory["kv_state"] == kept
    assert pred["offload"].memory == pred["recompute"].memory
    assert pred["keep"].step_s < pred["offload"].step_s < pred["recompute"].step_s
    assert pred["keep"].to_json()["reforward_attention"] == "keep"


def test_search_over_reforward_modes_is_exact():
    """With the mode searched (simulate --chunkflow-reforward-attention auto) the pruned search
    finds what brute force over every layout and mode finds, and its floor stays below every
    kept candidate's prediction."""
    shape = ModelShape(3, 2048, 5632, 16, 2, 32000)
    lengths = [4000, 9000, 65536]
    hw = dataclasses.replace(H100, memory_gib=6.9)  # keep does not fit where recompute does
    layouts = [lay for lay in candidate_layouts(shape, hw, 2, allow_cp=True)
               if 8192 % lay.chunk_multiple == 0 and runtime_layout(lay) == lay]
    preds = [predict_chunkflow(lengths, shape, hw, lay, 8192, 1, reforward=m)
             for lay in layouts for m in REFORWARD]
    fitting = [p for p in preds if p.fits]
    assert len(fitting) < len(preds)
    brute = min(fitting, key=lambda p: p.step_s)
    found = best_chunkflow(lengths, shape, hw, 2, 65536, chunk_size=8192, num_kept=1,
                           reforward=None)
    assert found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    assert found.fits and found.reforward_attention != "recompute"
    for lay in layouts:
        chunks = build_chunks(lengths, 8192, lay.dp, 1, shape, lay.segment_multiple,
                              lay.chunk_padding).chunks
        items = chunk_work_items(chunks, hw.attn_block, lay.cp, 1,
                                 "sharded" if lay.cp > 1 else False, lay.pad_multiple)
        model = roofline(shape, lay, hw)
        for m in REFORWARD:
            p = predict_chunkflow(lengths, shape, hw, lay, 8192, 1, reforward=m)
            assert time_floor(items, model, floor_sums(items, model, m)) <= p.step_s * (1 + 1e-9)


def test_keep_needs_a_backend_with_the_lse_pair():
    with pytest.raises(ValueError, match="--chunkflow-reforward-attention keep needs an "
                                         "attention backend with a backward from the "
                                         "log-sum-exp .*--attention-backend sdpa"):
        ChunkFlowConfig(reforward_attention="keep", attention_backend="sdpa")
    with pytest.raises(ValueError, match="--chunkflow-reforward-attention 'all': choose from "
                                         "recompute, keep, offload"):
        ChunkFlowConfig(reforward_attention="all")
    ChunkFlowConfig(reforward_attention="offload", attention_backend="auto")
    # the runtime checks the resolved backend again (auto may resolve to one without the pair)
    from megatron_chunkflow.runtime.reforward import check_pair

    check_pair("auto", torch.zeros(2, 1, 4))  # cpu_flash
    with pytest.raises(ValueError, match="--chunkflow-reforward-attention keep/offload needs an "
                                         "attention backend .*'sdpa' has none"):
        check_pair("sdpa", torch.zeros(2, 1, 4))
