"""Megatron's per-sample context parallelism (core/hybrid_cp.py): what Megatron refuses, each
sequence's padding, and the step arithmetic. Megatron's scheduler itself, read back into groups and
CP sizes: tests/mcore/test_hybrid_cp.py."""

import pytest

from megatron_chunkflow.core.hybrid_cp import (
    HybridSchedule,
    cp_size_needed,
    hybrid_schedule,
    hybrid_step_time,
    sequence_chunks,
)
from megatron_chunkflow.mcore.hybrid_cp import balanced_cp_groups


def test_cp_size_needed():
    assert [cp_size_needed(n, 4096) for n in (1, 4096, 4097, 8192, 8193, 32768, 40000)] == \
        [1, 1, 2, 2, 4, 8, 16]


def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="pool of 6 ranks must be a power of two"):
        hybrid_schedule([100, 200], 6, 1024, balanced_cp_groups)
    with pytest.raises(ValueError, match="pool of 1 ranks must be a power of two >= 2"):
        hybrid_schedule([100, 200], 1, 1024, balanced_cp_groups)
    with pytest.raises(ValueError, match=r"--max-seqlen-per-dp-cp-rank 1000: the longest sequence "
                                         r"\(9000 tokens\) would need a CP group of 16 ranks, more "
                                         r"than the DP x CP pool of 8; raise it to at least 1125"):
        hybrid_schedule([9000, 10], 8, 1000, balanced_cp_groups)
    assert max(hybrid_schedule([9000, 10], 8, 1125, balanced_cp_groups).cp) == 8
    with pytest.raises(ValueError, match="must be >= 1"):
        hybrid_schedule([10], 2, 0, balanced_cp_groups)


def test_padding_follows_each_sequence_cp_size():
    s = HybridSchedule(groups=(((0, 1), (0, 2)),), cp=(2, 1, 1))
    chunks = sequence_chunks([9, 5, 6], s)
    assert [c.computed_tokens for c in chunks] == [12, 5, 6]  # 2 x CP; none at CP 1
    assert [c.id for c in chunks] == [0, 1, 2] and all(c.num_tokens == n for c, n in
                                                       zip(chunks, [9, 5, 6]))


def test_step_time_is_groups_in_turn():
    """Group 1: sequence 0 on both ranks (CP 2); group 2: 1 and 2 on rank 0, 3 on rank 1."""
    s = HybridSchedule(groups=(((0,), (0,)), ((1, 2), (3,))), cp=(2, 1, 1, 1))
    cost = {0: (3.0, 6.0), 1: (1.0, 2.0), 2: (1.0, 2.0), 3: (2.0, 4.0)}
    step = hybrid_step_time(s, cost.__getitem__, barrier_s=0.5)
    assert step.group_times == (9.5, 6.5)
    assert step.step_time == 16.0
    assert step.busy == (15.0, 15.0)
    assert step.idle_ratio == pytest.approx(1 - 30 / 32)
    assert step.first_forward == 3.0 and step.last_backward == 2.0
