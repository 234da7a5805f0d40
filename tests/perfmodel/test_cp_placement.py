"""The hybrid CP placement in the cost and memory model (perfmodel/work.py, layer.py,
footprint.py, predict.py), as runtime/model.py runs it: a packed chunk's short segments whole on
one CP rank (core/cp_place.py), only the split ones ringed."""

import dataclasses

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.perfmodel.hardware import get_gpu
from megatron_chunkflow.perfmodel.held import chunk_tokens
from megatron_chunkflow.perfmodel.layer import chunk_work, layer_model, piece_pairs
from megatron_chunkflow.perfmodel.predict import predict_chunkflow

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
LENGTHS = [min(n, 8000) for n in sample_lengths("B", 120, seed=2)] + [50001]


def test_hybrid_placement_moves_nothing_for_segments_held_whole():
    """--chunkflow-cp-placement hybrid (core/cp_place.py): a chunk of short sequences keeps each
    whole on one rank: no K/V traffic, no ring kernels, its attention the compute alone; a chunk
    with one long segment splits only that one, the merges charged on its rows alone; the
    prediction charges the busiest rank's tokens and is faster than splitting every segment."""
    layout = P(tp=2, cp=2)
    short = build_chunks([1000] * 8, 8192, 1, 1, Q7B, segment_multiple=4,
                         chunk_multiple=8).chunks[0]
    w = chunk_work(short, 128, 2, gather=True, multiple=2)
    assert (w.gathered, w.selected, w.ring, w.whole) == (0, 0, False, w.tokens)
    assert w.tokens == 4000 and w.pairs == 4 * piece_pairs(0, 1000, 128)
    model = layer_model(Q7B, layout, H100)
    parts, base = model.parts(w), layer_model(Q7B, P(tp=2), H100)
    assert (parts.fwd_kernels, parts.bwd_kernels) == base.base_kernels
    slow = dataclasses.replace(H100, cp_overlap=0.0)
    assert layer_model(Q7B, layout, slow).attention(w.tokens, w.pairs, 0, False, False,
                                                    w.whole) == model.attention(
        w.tokens, w.pairs, 0, False, False, w.whole)
    split = chunk_work(short, 128, 2, gather=True, multiple=2, placement="split")
    assert split.gathered == 8000 and model.parts(split).fwd > parts.fwd

    mixed = build_chunks([6000, 1000, 1000], 8192, 1, 1, Q7B, segment_multiple=4,
                         chunk_multiple=8).chunks[0]
    m = chunk_work(mixed, 128, 2, gather=True, multiple=2)
    assert (m.gathered, m.whole, m.tokens, m.ring) == (6000, 1000, 4000, True)
    assert chunk_tokens(mixed, 2, 2) == m.tokens
    # the whole segments attend before the ring starts: none of their kernel hides its transfers
    assert 0 < m.whole_pairs < m.pairs
    args = (m.tokens, m.pairs, m.gathered, False, True, m.whole)
    slow_link = layer_model(Q7B, layout, dataclasses.replace(H100, nvlink_gb_s=2.0))
    alone, hidden = slow_link.attention(*args, m.whole_pairs), slow_link.attention(*args, 0.0)
    assert alone[0] > hidden[0] and alone[1] > hidden[1]
    hybrid = predict_chunkflow(LENGTHS, Q7B, H100, layout, 8192, 1)
    every = predict_chunkflow(LENGTHS, Q7B, H100, layout, 8192, 1, cp_placement="split")
    # the whole segments' ring traffic saved, the ranks' tokens balanced less evenly (each
    # rank's per-token work, the loss's fp32 softmax included): within 0.1% on this batch
    assert hybrid.step_s < every.step_s * 1.001 and hybrid.to_json()["cp_placement"] == "hybrid"
