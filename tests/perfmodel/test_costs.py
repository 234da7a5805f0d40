"""What the op costs charge beyond FLOPs (perfmodel/layer.py, roofline.py, predict.py): a
baseline's padding, the pipeline sends of each system, the kernel launch floor, CP overlap, and
ChunkFlow's K/V concatenation and fp32 accumulator traffic."""

import dataclasses
import math

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.packer import split_long
from megatron_chunkflow.core.profiles import sample_lengths
from megatron_chunkflow.core.step import baseline_microbatches
from megatron_chunkflow.core.types import DataChunk, Segment
from megatron_chunkflow.perfmodel.hardware import (
    KERNEL_LAUNCH_US,
    get_gpu,
    hardware_from_measurements,
    with_overrides,
)
from megatron_chunkflow.perfmodel.layer import (
    KERNELS_BWD,
    KERNELS_FWD,
    chunk_work,
    layer_model,
)
from megatron_chunkflow.perfmodel.predict import predict_megatron, roofline

P = ParallelConfig.layout  # a layout as the simulator models it (SP when TP > 1)

H100 = get_gpu("h100")
Q7B = get_model_shape("qwen2.5-7b")
Q05B = get_model_shape("qwen2.5-0.5b")
LENGTHS = [min(n, 32768) for n in sample_lengths("B", 300, seed=1)]


def test_sft_lines_compute_seq_length_tokens():
    """megatron-sft: every line is padded to --seq-length and computed whole: the chunks' work
    is lines x seq_length tokens; packed computes only the sequences."""
    sft = baseline_microbatches(LENGTHS, 32768, 2, "megatron-sft")
    packed = baseline_microbatches(LENGTHS, 32768, 2, "megatron-packed")
    assert sum(chunk_work(c, 128).tokens for c in sft) == len(sft) * 32768
    assert sum(chunk_work(c, 128).tokens for c in packed) == sum(LENGTHS)
    layout = P(tp=4, dp=2)
    p_sft, p_packed = (predict_megatron(LENGTHS, Q7B, H100, layout, 32768, b)
                       for b in ("megatron-sft", "megatron-packed"))
    assert p_sft.padding_fraction == pytest.approx(1 - sum(LENGTHS) / (len(sft) * 32768))
    assert p_packed.padding_fraction == 0.0
    assert p_sft.step_s > p_packed.step_s and p_sft.model_flops == p_packed.model_flops


@pytest.mark.parametrize("baseline", ["megatron-packed", "megatron-unpacked", "megatron-sft"])
def test_cp_pads_every_sequence_to_twice_cp(baseline):
    cp = 4
    mbs = baseline_microbatches(LENGTHS, 32768, 1, baseline, cp)
    for c in mbs:
        for s in c.segments[:-1] if baseline == "megatron-sft" else c.segments:
            assert s.computed_tokens % (2 * cp) == 0 and s.padding < 2 * cp
        assert chunk_work(c, 128, cp).tokens == math.ceil(c.computed_tokens / cp)
    p = predict_megatron(LENGTHS, Q7B, H100, P(tp=2, cp=cp), 32768, baseline)
    assert p.padding_fraction > 0


def test_sends_fixed_variable_and_async():
    """megatron-sft sends --seq-length shapes, megatron-packed/-unpacked their own after a
    handshake (a second message), blocking the sender; ChunkFlow's receiver waits for one
    message of the chunk size."""
    model = roofline(Q7B, P(tp=4, pp=2), H100)
    latency = H100.link(P(tp=4, pp=2).span("pp"))[1]
    chunks = baseline_microbatches(LENGTHS, 32768, 1, "megatron-packed")
    fixed = model.stage_costs(chunks, 2, 32768, "fixed")
    variable = model.stage_costs(chunks, 2, 32768, "variable")
    async_ = model.stage_costs(chunks, 2, 8192, "async")
    assert fixed.comm == latency and variable.comm == 2 * latency
    assert async_.comm == pytest.approx(latency + model.p2p_bytes_time(8192)) and not async_.send
    small = min(chunks, key=lambda c: c.computed_tokens)
    assert fixed.send[small.id] == model.p2p_bytes_time(32768)
    assert variable.send[small.id] == model.p2p_bytes_time(small.computed_tokens)
    for costs in (fixed, variable):  # F sends except on the last stage, B except on the first
        assert costs("F", small.id, 0) == async_("F", small.id, 0) + costs.send[small.id]
        assert costs("F", small.id, 1) == async_("F", small.id, 1)
        assert costs("B", small.id, 0) == async_("B", small.id, 0)
        assert costs("B", small.id, 1) == async_("B", small.id, 1) + costs.send[small.id]


def test_launch_floor():
    """A layer cannot run faster than its kernels can be launched: short micro-batches of a
    small model are launch-bound, long ones are not; measured CPU devices have no such floor."""
    assert H100.kernel_launch_us == KERNEL_LAUNCH_US > 0
    free = dataclasses.replace(H100, kernel_launch_us=0.0)
    short, long = (DataChunk(0, "standalone", (Segment(0, 0, n),)) for n in (64, 16384))
    layers = Q05B.num_layers
    ((fwd,), (bwd,)) = roofline(Q05B, P(), H100).chunk_costs(short, 1)
    ((fwd0,), (bwd0,)) = roofline(Q05B, P(), free).chunk_costs(short, 1)
    launch = KERNEL_LAUNCH_US * 1e-6
    roof = layer_model(Q05B, P(), H100).parts(chunk_work(short, 128))
    assert roof.fwd < KERNELS_FWD * launch and roof.bwd < KERNELS_BWD * launch
    assert fwd - fwd0 == pytest.approx(layers * (KERNELS_FWD * launch - roof.fwd))
    assert bwd - bwd0 == pytest.approx(layers * (KERNELS_BWD * launch - roof.bwd))
    assert roofline(Q05B, P(), H100).chunk_costs(long, 1) == \
        roofline(Q05B, P(), free).chunk_costs(long, 1)
    cpu = hardware_from_measurements(50e9, 20e9, 15e9, 8e9, 2e9)
    assert cpu.kernel_launch_us == 0.0
    unpacked = [predict_megatron(LENGTHS, Q05B, hw, P(tp=1, dp=8), 32768,
                                 "megatron-unpacked").step_s for hw in (free, H100)]
    assert unpacked[1] > 1.02 * unpacked[0]  # hundreds of short micro-batches


def test_cp_overlap_range():
    """Attention under CP costs compute + transfer - overlap x min(compute, transfer): the sum
    at 0, the max at 1; predictions order accordingly."""
    model = {o: layer_model(Q7B, P(tp=1, cp=8), with_overrides(H100, [f"cp_overlap={o}"]))
             for o in (0.0, H100.cp_overlap, 1.0)}
    zero, mid, one = (model[o].attention(4096, 4096.0 * 4096 / 2) for o in model)
    raw = layer_model(Q7B, P(tp=1), H100).attention(4096, 4096.0 * 4096 / 2)
    bw, latency = H100.link(P(tp=1, cp=8).span("cp"))
    transfer = 7 * 4096 * 2 * Q7B.kv_dim * 2 / bw
    assert zero[0] == pytest.approx(raw[0] + transfer + latency)
    assert one[0] == pytest.approx(max(raw[0], transfer) + latency)
    assert one[0] <= mid[0] <= zero[0] and one[1] <= mid[1] <= zero[1]
    steps = [predict_megatron(LENGTHS, Q7B, with_overrides(H100, [f"cp_overlap={o}"]),
                              P(tp=1, cp=8, dp=4), 32768).step_s for o in (0, 0.8, 1)]
    assert steps[0] > steps[1] > steps[2]
    with pytest.raises(ValueError, match="cp_overlap"):
        with_overrides(H100, ["cp_overlap=1.5"])


def test_chunkflow_state_traffic():
    """A dependent chunk's forward (the re-forward charged alike) reads its own K/V and writes
    them into its sequence's buffer, whatever its prefix; its backward read-modify-writes the
    prefix's fp32 accumulator and adds its own rows; both every layer; a standalone chunk has
    neither."""
    layout, C = P(tp=4), 4096
    chunks = split_long(0, 5 * C, C, 0)
    lm = layer_model(Q7B, layout, H100)
    kv = 2 * Q7B.kv_dim // 4  # K and V elements per token on a TP rank
    mem_bw = H100.hbm_gb_s * 1e9 * H100.mem_eff
    for c in chunks:
        w = chunk_work(c, 128)
        fwd, bwd = lm.state_traffic(w)
        prefix = c.index * C
        assert fwd == pytest.approx(2 * C * kv * 2 / mem_bw) == lm.kv_write(w)
        own = C * kv * 12 if c.index < 4 else 0  # the last chunk has no relayed accumulator
        assert bwd == pytest.approx((prefix * kv * 10 + own) / mem_bw)
    alone = chunk_work(DataChunk(9, "standalone", (Segment(1, 0, C),)), 128)
    assert lm.state_traffic(alone) == (0.0, 0.0)
    # the charge shows in the op costs: the last chunk's forward exceeds a standalone chunk's
    # of the same length by its attention over the prefix and the write
    model = roofline(Q7B, layout, H100)
    assert model.chunk_costs(chunks[-1], 1)[0][0] > model.chunk_costs(
        DataChunk(9, "standalone", (Segment(1, 0, C),)), 1)[0][0]
