"""A whole step for ChunkFlow and the stock-Megatron baseline (core.step), memory model included."""

import pytest

from megatron_chunkflow.core.costs import activation_bytes_per_token, kv_state_bytes_per_token
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.step import plan_baseline, plan_chunkflow

SHAPE = get_model_shape("qwen2.5-7b")


@pytest.mark.parametrize("pp", [1, 4])
def test_activation_memory_follows_chunk_size(pp):
    """Growing the longest sequence 8x: ChunkFlow's held activations stay put (only the K/V state
    grows, linearly), the baseline's grow with the micro-batch length."""
    C, short = 4096, [700] * 50
    cf_held, cf_state, base = [], [], []
    for longest in (32768, 262144):
        _, cf = plan_chunkflow(short + [longest], C, 1, pp, 1, SHAPE)
        cf_held.append(cf.sims[0].peak_bytes)
        cf_state.append(cf.state_bytes[0])
        base.append(plan_baseline(short + [longest], longest, pp, 1, SHAPE).peak_memory_bytes(0))
    assert cf_held[0] == cf_held[1]
    assert cf_state[1][0] == pytest.approx(8 * cf_state[0][0])
    assert base[1][0] > 3 * base[0][0]  # fewer max-length micro-batches in flight, each 8x
    per_token = activation_bytes_per_token(SHAPE, SHAPE.num_layers // pp)
    assert cf_held[0][0] <= max(pp, 1) * C * per_token  # at most max(p - s, K) chunks held
    assert cf_state[0][0] == 32768 * kv_state_bytes_per_token(SHAPE, SHAPE.num_layers // pp)


def test_baseline_rejects_sequences_over_seq_length():
    with pytest.raises(ValueError, match="sequence 1 has 900 tokens, more than --seq-length 800"):
        plan_baseline([100, 900], 800, 1, 1, SHAPE)


def test_dp_step_time_is_slowest_rank():
    _, cf = plan_chunkflow([5000] * 7 + [40000], 4096, 1, 2, 3, SHAPE)
    assert cf.step_time == max(s.step_time for s in cf.sims)
    assert len({s.step_time for s in cf.sims}) > 1


def test_sequence_model_flops_counts_attention_per_sequence():
    """Equal to the chunk cost model on one standalone chunk per sequence; packing does not add
    cross-sequence attention."""
    from megatron_chunkflow.core.costs import chunk_flops, sequence_model_flops
    from megatron_chunkflow.core.packer import build_chunks

    lengths = [700, 5, 3000]
    chunks = build_chunks(lengths, max(lengths) + 1).chunks
    by_chunk = 3.0 * sum(chunk_flops(c, SHAPE).forward(SHAPE.num_layers) for c in chunks)
    assert sequence_model_flops(lengths, SHAPE) == pytest.approx(by_chunk, rel=1e-12)
