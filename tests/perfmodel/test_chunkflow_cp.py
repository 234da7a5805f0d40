"""ChunkFlow with context parallelism in the cost and memory model (perfmodel/layer.py,
footprint.py, predict.py, floors.py, search.py), as runtime/cp.py runs it: segments padded to
2 x CP (chunks to 2 x CP x TP) and zigzag-sharded, K/V passed around a ring per layer and chunk
behind the kernels, again in the backward, which runs from the saved log-sum-exp (no second
attention forward) and passes dK/dV back in fp32, state 1/CP per rank."""

import dataclasses

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.costs import attention_pairs
from megatron_chunkflow.core.models import ModelShape, get_model_shape
from megatron_chunkflow.core.packer import build_chunks
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.perfmodel.floors import chunk_work_items, time_floor
from megatron_chunkflow.perfmodel.hardware import get_gpu, with_overrides
from megatron_chunkflow.perfmodel.held import chunk_tokens
from megatron_chunkflow.perfmodel.kvstate import (
    gather_transient_bytes,
    kv_state_bytes_per_token,
    sequence_state_bytes,
)
from megatron_chunkflow.perfmodel.layer import (
    GATHER_KERNELS_BWD,
    GATHER_KERNELS_FWD,
    RING_KERNELS_PER_STEP,
    RING_MERGE_BYTES,
    chunk_work,
    gather_extent,
    layer_model,
    zigzag_pairs,
    zigzag_split_pairs,
)
from megatron_chunkflow.perfmodel.memfloors import chunkflow_memory_floor
from megatron_chunkflow.perfmodel.predict import (
    cp_padded_lengths,
    predict_chunkflow,
    roofline,
    runtime_layout,
    with_padding,
)
from megatron_chunkflow.perfmodel.search import (
    CP_KV,
    best_chunkflow,
    candidate_layouts,
    chunking_candidates,
)

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
LONG = 50001  # odd: its last chunk needs padding under CP
LENGTHS = [min(n, 8000) for n in sample_lengths("B", 120, seed=2)] + [LONG]


def chunks_for(layout: ParallelConfig, chunk_size: int, k: int = 1, lengths=LENGTHS):
    return build_chunks(lengths, chunk_size, layout.dp, k, Q7B,
                        segment_multiple=layout.segment_multiple,
                        chunk_multiple=layout.chunk_padding).chunks


def test_padding_matches_the_runtime_packer():
    """predict_chunkflow cuts and packs padded lengths (the segments' multiple given to the
    lengths, the chunks' to the packer) and turns the rounding back into padding: the same chunks
    as core/packer's. Segments are padded to 2 x CP (as Megatron pads each sequence), chunks to
    2 x CP x TP under sequence parallelism (each rank's share splits over TP), by their last
    segment."""
    for layout in (P(tp=2, cp=2), P(tp=1, cp=4, dp=2), P(tp=4, cp=2)):
        m, whole = layout.segment_multiple, layout.chunk_padding
        assert (m, whole) == (2 * layout.cp, 2 * layout.cp * layout.tp)
        ours = with_padding(build_chunks(cp_padded_lengths(LENGTHS, m), 4096, layout.dp, 2,
                                         Q7B, chunk_multiple=whole).chunks, LENGTHS)
        assert ours == list(chunks_for(layout, 4096, 2))
        for c in ours:
            assert c.computed_tokens % whole == 0
            for s in c.segments[:-1]:
                assert s.computed_tokens % m == 0 and s.padding < m
            assert c.segments[-1].computed_tokens % m == 0 and c.segments[-1].padding < whole
        assert sum(c.num_tokens for c in ours) == sum(LENGTHS)
        if layout.tp > 1:  # less padding than segments padded to 2 x CP x TP each
            old = build_chunks(LENGTHS, 4096, layout.dp, 2, Q7B, segment_multiple=whole).chunks
            assert (sum(c.computed_tokens for c in ours)
                    < sum(c.computed_tokens for c in old))


def test_cp2_halves_dense_tokens_and_activations_per_rank():
    """Each CP rank computes 1/CP of every chunk's tokens (every segment split): per-rank GEMM
    work and the activations a chunk holds halve at CP 2 on the same padded chunks."""
    cp1, cp2 = P(tp=2), P(tp=2, cp=2)
    for c in chunks_for(cp2, 8192):
        w = chunk_work(c, 128, 2, gather=True, placement="split")
        assert 2 * w.tokens == c.computed_tokens == chunk_work(c, 128).tokens
        assert chunk_tokens(c, 2) == w.tokens and w.whole == 0
    dense1 = layer_model(Q7B, cp1, H100).dense(8192)
    dense2 = layer_model(Q7B, cp2, H100).dense(4096)
    assert dense2.fwd < 0.6 * dense1.fwd
    p1 = predict_chunkflow(LENGTHS, Q7B, H100, P(tp=2, dp=2), 8192, 1)
    p2 = predict_chunkflow(LENGTHS, Q7B, H100, cp2, 8192, 1)
    assert p2.memory["kv_state"] == pytest.approx(p1.memory["kv_state"] / 2, rel=0.01)


def test_zigzag_pairs_are_balanced_and_add_up():
    """Pieces r and 2 CP - 1 - r give every rank the same exact pairs; over the ranks they are
    the unsplit segment's (prefix included); with 128-tiles each rank pays its pieces' tiles."""
    for prefix, n, cp in ((0, 4096, 2), (8192, 4096, 4), (30000, 1000, 2), (0, 96, 8)):
        exact = zigzag_pairs(prefix, n, 0, cp)
        assert len(set(exact)) == 1
        assert sum(exact) == attention_pairs(prefix, n)
        tiled = zigzag_pairs(prefix, n, 128, cp)
        assert all(t >= e for t, e in zip(tiled, exact))
    # a dependent chunk: the slowest rank's pairs, about 1/CP of the chunk's
    c = [c for c in chunks_for(P(tp=1, cp=2), 8192) if c.is_dependent][-1]
    w = chunk_work(c, 0, 2, gather=True)
    assert w.pairs == pytest.approx(attention_pairs(c.prefix_len, c.computed_tokens) / 2)


def test_gather_bytes_and_backward_from_the_lse():
    """Forward: an exposed ring all-gather of (prefix + chunk) tokens of K and V, (CP - 1)/CP of
    them received, then the kernel; backward: the gather again, the kernel's backward from the
    saved log-sum-exp (no kernel forward) and a reduce-scatter of dK/dV in fp32 (twice the
    gather's bytes under bf16). CP overlap does not hide any of it."""
    tp, cp, gathered = 2, 4, 40960
    layout = P(tp=tp, cp=cp)
    lm = layer_model(Q7B, layout, H100)
    bw, latency = H100.link(layout.span("cp"))
    kv_width = Q7B.kv_dim // tp  # K (or V) channels on this TP rank
    gather_bytes = gathered * 2 * kv_width * H100.dtype_bytes
    gather, scatter = lm.gather_times(gathered)
    assert gather == pytest.approx((cp - 1) / cp * gather_bytes / bw + (cp - 1) * latency)
    assert scatter == pytest.approx((cp - 1) / cp * 2 * gather_bytes / bw + (cp - 1) * latency)
    tokens, pairs = 2048, 8.0e7
    compute_f, compute_b = layer_model(Q7B, P(tp=tp), H100).attention(tokens, pairs)
    fwd, bwd = lm.attention(tokens, pairs, gathered)
    assert fwd == pytest.approx(gather + compute_f)
    assert bwd == pytest.approx(gather + compute_b + scatter)
    for overlap in (0.0, 1.0):
        other = layer_model(Q7B, layout, with_overrides(H100, [f"cp_overlap={overlap}"]))
        assert other.attention(tokens, pairs, gathered) == pytest.approx((fwd, bwd))
    # Megatron's ring on the same layout is a different (overlapped) model
    assert lm.attention(tokens, pairs) != pytest.approx((fwd, bwd))


def test_ring_hides_its_transfers_as_megatron_ring_does():
    """The default CP attention, a ring: its pairs are each rank's own block's (causal) and the
    other blocks' (whole tiles), exactly the zigzag pairs without tiles; its K/V and gradient
    blocks travel behind the kernels as Megatron's ring's do (cp_overlap of the shorter hidden),
    but for the last gradient block; each step after the first merges (query-side copies)."""
    p = 1024
    for prefix, cp in ((0, 2), (8 * 4096, 2), (8 * 4096, 4)):
        n = 2 * cp * p
        split = zigzag_split_pairs(prefix, n, 0, cp)
        assert [a + b for a, b in split] == list(zigzag_pairs(prefix, n, 0, cp))  # exact
        for own, _ in split:  # the rank's prefix shards, its two pieces
            assert own == attention_pairs(prefix // cp, p) + attention_pairs(prefix // cp + p, p)
    for cp in (2, 4, 8):
        layout = P(tp=2, cp=cp)
        lm = layer_model(Q7B, layout, H100)
        tokens, pairs, gathered = 2048, 8.0e7, 40960
        gather, scatter = lm.gather_times(gathered)
        compute_f, compute_b = layer_model(Q7B, P(tp=2), H100).attention(tokens, pairs)
        merge = (cp - 1) * tokens * lm.attn_width * H100.dtype_bytes / lm.mem_bw
        fwd, bwd = lm.attention(tokens, pairs, gathered, ring=True)
        hidden, last = H100.cp_overlap, scatter / (cp - 1)
        moved = gather + scatter - last
        assert fwd == pytest.approx(compute_f + gather - hidden * min(gather, compute_f)
                                    + RING_MERGE_BYTES[0] * merge)
        assert bwd == pytest.approx(compute_b + moved - hidden * min(moved, compute_b) + last
                                    + RING_MERGE_BYTES[1] * merge)
        serial = lm.attention(tokens, pairs, gathered)  # gathered first
        assert fwd < serial[0] and bwd < serial[1]
    # a 256K sequence whole at CP 2: all of its K/V traffic is hidden at cp_overlap 1
    (seq,) = build_chunks([262144], 262144, 1, 1, Q7B, segment_multiple=4).chunks
    w = chunk_work(seq, 128, 2, gather=True)
    assert w.ring and chunk_work(seq, 128, 2, gather="replicated").ring  # standalone: both
    full = layer_model(Q7B, P(tp=2, cp=2), with_overrides(H100, ["cp_overlap=1"]))
    g, sc = full.gather_times(w.gathered)
    f, b = full.attention(w.tokens, w.pairs, w.gathered, ring=True)
    alone_f, alone_b = layer_model(Q7B, P(tp=2), H100).attention(w.tokens, w.pairs)
    per = w.tokens * full.attn_width * H100.dtype_bytes / full.mem_bw
    assert g < 0.1 * alone_f
    assert f == pytest.approx(alone_f + RING_MERGE_BYTES[0] * per, rel=1e-9)
    assert b == pytest.approx(alone_b + sc + RING_MERGE_BYTES[1] * per, rel=1e-9)


def test_chunk_work_gathers_the_prefix():
    """A dependent chunk gathers its sequence's prefix and itself; its pieces read the prefix
    twice (one per piece) and their own segment up to their end; its kernels are the gather
    path's, not the ring's."""
    layout = P(tp=1, cp=2)
    deps = [c for c in chunks_for(layout, 8192) if c.is_dependent]
    last = deps[-1]
    w = chunk_work(last, 128, 2, gather=True)
    assert w.gathered == last.prefix_len + last.computed_tokens == LONG + last.segments[0].padding
    assert w.selected == 2 * last.prefix_len + last.computed_tokens * 5 // 4
    assert (w.gathered, w.selected) == gather_extent(last.prefix_len, last.computed_tokens, 2)
    assert w.prior == last.index and not w.relayed and deps[0].prefix_len == 0
    parts = layer_model(Q7B, layout, H100).parts(w)
    base = layer_model(Q7B, P(), H100)
    # + the ring's second step, the K/V write into the buffer and the accumulator's two adds
    assert parts.fwd_kernels == base.kernels_fwd + GATHER_KERNELS_FWD + RING_KERNELS_PER_STEP[0] + 2
    assert parts.bwd_kernels == (base.kernels_bwd + GATHER_KERNELS_BWD + RING_KERNELS_PER_STEP[1]
                                 + 2)
    # the step: every layer's backward gathers again and reduce-scatters: B / F above CP 1's
    model = roofline(Q7B, layout, H100)
    f, b = model.chunk_costs(last, 1, gather=True)
    f1, b1 = roofline(Q7B, P(), H100).chunk_costs(last, 1)
    assert b[0] / f[0] > b1[0] / f1[0]


def test_state_per_rank_halves_at_cp2():
    """A long sequence's K/V buffer, fp32 accumulator and re-forward inputs are
    1/CP per rank; the transient of its attention (the gathered K/V and the selection) is whole."""
    L, C = 120000, 8192
    for pp in (1, 2):
        for k in (1, 4):
            one = sequence_state_bytes(L, C, k, Q7B, P(tp=2, pp=pp), 2, pp)
            two = sequence_state_bytes(L, C, k, Q7B, P(tp=2, cp=2, pp=pp), 2, pp)
            assert two == pytest.approx([x / 2 for x in one])
    layout = P(tp=2, cp=2)
    chunks = chunks_for(layout, C, lengths=[L])
    last = chunks[-1]
    kv = kv_state_bytes_per_token(Q7B, 1, 2, 2, with_grad=False)
    g, s = gather_extent(last.prefix_len, last.computed_tokens, 2)
    assert gather_transient_bytes(chunks, Q7B, layout, 2) == pytest.approx(max(2 * s, 3 * g) * kv)
    assert gather_transient_bytes(chunks, Q7B, P(tp=2), 2) == 0.0
    p1 = predict_chunkflow([L], Q7B, H100, P(tp=2), C, 1)
    p2 = predict_chunkflow([L], Q7B, H100, P(tp=2, cp=2), C, 1)
    assert p2.memory["kv_state"] == pytest.approx(p1.memory["kv_state"] / 2)
    assert p2.memory["activations"] == pytest.approx(p1.memory["activations"] / 2, rel=0.01)
    assert p2.memory["transient"] > p1.memory["transient"] / 2  # the whole gathered K/V


def test_bad_chunk_size_names_the_flag():
    with pytest.raises(ValueError, match=r"--chunk-size 4100 is not a multiple of 2 x CP 2 x "
                                         r"TP 2 \(sequence parallelism\) = 8"):
        predict_chunkflow(LENGTHS, Q7B, H100, P(tp=2, cp=2), 4100, 1)
    with pytest.raises(ValueError, match=r"--chunk-size 4098 is not a multiple of 2 x CP 2 = 4"):
        predict_chunkflow(LENGTHS, Q7B, H100, P(tp=1, cp=2), 4098, 1)
    assert predict_chunkflow(LENGTHS, Q7B, H100, P(tp=1, cp=2), 4100, 1).step_s > 0
    assert [c for c, _ in chunking_candidates(LENGTHS, 32768, 24)] == []  # no power of 2 fits
    assert chunking_candidates(LENGTHS, 32768, 8) == chunking_candidates(LENGTHS, 32768, 1)


SHAPE = ModelShape(4, 2048, 5632, 16, 4, 32000)
SEQ = 65536
CP_LENGTHS = [min(n, 4000) for n in sample_lengths("B", 40, seed=5)] + [60000]


def fastest_fitting(predictions):
    return min((p for p in predictions if p.fits), key=lambda p: p.step_s)


def test_search_picks_cp_and_is_exact():
    """3 layers and 2 K/V groups on 4 GPUs: no PP 2 or 4 and TP <= 2, so the long sequence is
    fastest split over CP (DP 2 would leave it on one replica); the pruned search finds what
    brute force over every layout, CP included, finds."""
    shape = ModelShape(3, 2048, 5632, 16, 2, 32000)
    layouts = candidate_layouts(shape, H100, 4, allow_cp=True)
    brute = fastest_fitting(predict_chunkflow(CP_LENGTHS, shape, H100, lay, 8192, 1, kv)
                            for lay in layouts if 8192 % lay.chunk_multiple == 0
                            for kv in (CP_KV if lay.cp > 1 else CP_KV[:1]))
    found = best_chunkflow(CP_LENGTHS, shape, H100, 4, SEQ, chunk_size=8192, num_kept=1)
    assert found.fits and found.layout.cp > 1
    assert found.step_s == pytest.approx(brute.step_s, rel=1e-12)
    no_cp = fastest_fitting(predict_chunkflow(CP_LENGTHS, shape, H100, lay, 8192, 1)
                            for lay in layouts if lay.cp == 1)
    assert found.step_s < no_cp.step_s


def test_floors_bound_cp_candidates():
    """The time floor (with the long sequence's chain) and the memory floor stay below the
    prediction for ChunkFlow's CP layouts too."""
    hw = get_gpu("h100")
    for lay in [x for x in candidate_layouts(SHAPE, hw, 4, allow_cp=True)
                if runtime_layout(x) == x][::5]:  # the layouts the search keeps
        for c, k in chunking_candidates(CP_LENGTHS, SEQ, lay.chunk_multiple)[::3]:
            for kv in CP_KV:
                p = predict_chunkflow(CP_LENGTHS, SHAPE, hw, lay, c, k, kv)
                chunks = build_chunks(CP_LENGTHS, c, lay.dp, k, SHAPE,
                                      segment_multiple=lay.segment_multiple).chunks
                items = chunk_work_items(chunks, hw.attn_block, lay.cp, k, gather=kv)
                assert time_floor(items, roofline(SHAPE, lay, hw)) <= p.step_s * (1 + 1e-9)
                floor = chunkflow_memory_floor(CP_LENGTHS, SHAPE, lay, hw.dtype_bytes, c, k)
                assert floor <= p.peak_mem_bytes * (1 + 1e-9)


def test_chain_floor_binds_on_deep_pipelines():
    """With few chunks on many stages the long sequence's chain (every chunk forward on one
    stage, the last through all of them, and back) is above the busiest stage's work."""
    hw = get_gpu("h100")
    lengths = [60000, 3000, 2000]
    lay = P(tp=1, pp=4)
    chunks = build_chunks(lengths, 16384, 1, 1, SHAPE).chunks
    items = chunk_work_items(chunks, hw.attn_block, 1, 1)
    model = roofline(SHAPE, lay, hw)
    chained = time_floor(items, model)
    unchained = time_floor([(r, f, w, None) for r, f, w, _ in items], model)
    p = predict_chunkflow(lengths, SHAPE, hw, lay, 16384, 1)
    assert unchained < chained <= p.step_s * (1 + 1e-9)
    assert chained > 0.6 * p.step_s


def test_cp_prediction_is_consistent():
    """A CP layout's prediction: padding counted, model FLOPs those of the real tokens, the same
    faster where more of the overlapped gather is hidden."""
    lay = P(tp=2, cp=2, dp=2)
    p = predict_chunkflow(LENGTHS, Q7B, H100, lay, 8192, 2)
    q = predict_chunkflow(LENGTHS, Q7B, dataclasses.replace(H100, cp_overlap=0.0), lay, 8192, 2)
    assert p.step_s < q.step_s and p.layout.cp == 2 and p.num_tokens == sum(LENGTHS)
    assert 0 < p.padding_fraction < 0.01
    base = predict_chunkflow(LENGTHS, Q7B, H100, P(tp=2, dp=4), 8192, 2)
    assert p.model_flops == base.model_flops and p.num_gpus == base.num_gpus


def test_replicated_state_gathers_the_chunk_only():
    """--chunkflow-cp-kv replicated, as runtime/cp.py runs it: a dependent chunk's layer gathers
    its own K/V forward and reduce-scatters its own dK/dV backward, with no gather again; the
    prefix costs no traffic; the stored K/V and accumulators are whole on every CP rank (CP times
    the sharded state) while the stage inputs stay 1/CP."""
    shape, lay = SHAPE, P(tp=1, cp=4, dp=1)
    hw = get_gpu("h100")
    (seq,) = [c for c in build_chunks([8 * 4096], 4096, 1, 1, shape,
                                      segment_multiple=lay.segment_multiple).chunks
              if c.is_dependent and c.index == 5]
    sharded = chunk_work(seq, hw.attn_block, 4, "sharded")
    replicated = chunk_work(seq, hw.attn_block, 4, "replicated")
    assert (sharded.gathered, replicated.gathered) == (6 * 4096, 4096) and replicated.replicated
    assert replicated._replace(gathered=0, replicated=False) == sharded._replace(gathered=0,
                                                                                ring=False)
    model = roofline(shape, lay, hw).layer
    gather, scatter = model.gather_times(4096)
    g6, s6 = model.gather_times(6 * 4096)  # [5 chunks of prefix ++ the chunk]
    f_rep, b_rep = model.attention(replicated.tokens, replicated.pairs, 4096, True)
    f_sh, b_sh = model.attention(sharded.tokens, sharded.pairs, sharded.gathered)
    assert f_rep == pytest.approx(f_sh - g6 + gather, rel=1e-12)  # the same kernel
    assert b_rep == pytest.approx(b_sh - g6 - s6 + scatter, rel=1e-12)  # no gather again
    whole = sequence_state_bytes(8 * 4096, 4096, 1, shape, lay, 2, 1, "replicated")
    split = sequence_state_bytes(8 * 4096, 4096, 1, shape, lay, 2, 1, "sharded")
    assert whole[0] == pytest.approx(4 * split[0], rel=1e-12)  # stage 0 keeps no stage inputs
    p_rep = predict_chunkflow(CP_LENGTHS, shape, hw, lay, 4096, 1, "replicated")
    p_sh = predict_chunkflow(CP_LENGTHS, shape, hw, lay, 4096, 1, "sharded")
    assert p_rep.step_s < p_sh.step_s and p_rep.peak_mem_bytes > p_sh.peak_mem_bytes
    assert p_rep.to_json()["cp_kv"] == "replicated" and "cp_kv" not in predict_chunkflow(
        CP_LENGTHS, shape, hw, P(tp=1, dp=4), 4096, 1).to_json()


def test_core_attn_recompute_under_cp_is_what_the_runtime_runs():
    """Under ChunkFlow's CP the runtime switches Megatron's core_attn checkpoint off (its
    attention runs its own backward), so a core_attn option costs and holds what the option
    without it does; the prediction still names the layout asked for."""
    hw = get_gpu("h100")
    for asked, runs in (("selective", "none"), ("selective:core_attn+mlp", "selective:mlp")):
        lay = P(tp=2, cp=2, dp=1, recompute=asked)
        assert runtime_layout(lay) == P(tp=2, cp=2, dp=1, recompute=runs)
        a = predict_chunkflow(CP_LENGTHS, SHAPE, hw, lay, 8192, 1)
        b = predict_chunkflow(CP_LENGTHS, SHAPE, hw, runtime_layout(lay), 8192, 1)
        assert (a.step_s, a.peak_mem_bytes) == (b.step_s, b.peak_mem_bytes)
        assert a.layout == lay
    flat = P(tp=2, dp=2, recompute="selective")
    assert runtime_layout(flat) == flat  # without CP Megatron's checkpoint runs

