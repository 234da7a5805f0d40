"""A whole step for ChunkFlow and the stock-Megatron baseline (core.step), with and without the
memory hooks (perfmodel/footprint.py's model)."""

import pytest

from megatron_chunkflow.config import ParallelConfig
from megatron_chunkflow.core.models import get_model_shape
from megatron_chunkflow.core.step import plan_baseline, plan_chunkflow
from megatron_chunkflow.perfmodel.footprint import per_token_bytes
from megatron_chunkflow.perfmodel.held import memory_hooks
from megatron_chunkflow.perfmodel.kvstate import kv_state_bytes_per_token

SHAPE = get_model_shape("qwen2.5-7b")


@pytest.mark.parametrize("pp", [1, 4])
def test_activation_memory_follows_chunk_size(pp):
    """Growing the longest sequence 8x: ChunkFlow's held activations stay put (only the K/V state
    grows, linearly), the baseline's grow with the micro-batch length."""
    C, short = 4096, [700] * 50
    held_for, state_for = memory_hooks(SHAPE, ParallelConfig.layout(pp=pp), 2, C, 1)
    cf_held, cf_state, base = [], [], []
    for longest in (32768, 262144):
        _, cf = plan_chunkflow(short + [longest], C, 1, pp, 1, SHAPE, held_bytes_for=held_for,
                               state_bytes_for=state_for)
        cf_held.append(cf.sims[0].peak_bytes)
        cf_state.append(cf.state_bytes[0])
        base.append(plan_baseline(short + [longest], longest, pp, 1, SHAPE,
                                  held_bytes_for=held_for).peak_memory_bytes(0))
    assert cf_held[0] == cf_held[1]
    assert base[1][0] > 3 * base[0][0]  # fewer max-length micro-batches in flight, each 8x
    per_token = per_token_bytes(SHAPE, ParallelConfig.layout(pp=pp), 2, pp)[0]
    assert cf_held[0][0] <= max(pp, 1) * C * per_token  # at most max(p - s, K) chunks held
    u = kv_state_bytes_per_token(SHAPE, SHAPE.num_layers // pp, with_grad=False)
    a = kv_state_bytes_per_token(SHAPE, SHAPE.num_layers // pp) - u
    assert cf_state[0][0] == 8 * C * u + 7 * C * a  # K/V buffer of 8 chunks, prefix accumulator
    assert cf_state[1][0] == 64 * C * u + 63 * C * a  # 8x the sequence, 8x the state


def test_without_memory_hooks_the_plan_counts_no_bytes():
    """core models time only: with no hooks every byte count is zero, the plan unchanged."""
    lengths = [700] * 50 + [20000]
    _, bare = plan_chunkflow(lengths, 4096, 1, 2, 1, SHAPE)
    held_for, state_for = memory_hooks(SHAPE, ParallelConfig.layout(pp=2), 2, 4096, 1)
    _, hooked = plan_chunkflow(lengths, 4096, 1, 2, 1, SHAPE, held_bytes_for=held_for,
                               state_bytes_for=state_for)
    assert bare.peak_memory_bytes(0) == (0.0, 0.0) and min(hooked.peak_memory_bytes(0)) > 0
    assert bare.plans == hooked.plans and bare.step_time == hooked.step_time
    assert plan_baseline(lengths, 20000, 2, 1, SHAPE).peak_memory_bytes(0) == (0.0, 0.0)


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
    chunks = build_chunks(lengths, max(lengths) + 1, 1, 1, SHAPE).chunks
    by_chunk = 3.0 * sum(chunk_flops(c, SHAPE).forward(SHAPE.num_layers) for c in chunks)
    assert sequence_model_flops(lengths, SHAPE) == pytest.approx(by_chunk, rel=1e-12)
