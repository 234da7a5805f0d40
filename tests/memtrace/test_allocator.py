"""The CUDA caching allocator's rules, replayed (memtrace/allocator.py), on hand-made request
sequences whose blocks and segments are worked out in the comments.

    python -m pytest tests/memtrace/test_allocator.py -q
"""

from megatron_chunkflow.memtrace.allocator import replay, segment_bytes
from megatron_chunkflow.memtrace.ledger import Event, block_bytes

MiB = 1 << 20


def _events(*ops):
    """("+", key, bytes) allocates, ("-", key) frees."""
    return [Event(op[1], op[2], None) if op[0] == "+" else Event(op[1], 0, None) for op in ops]


def test_requests_round_to_512_bytes_and_segments_to_the_pool():
    assert [block_bytes(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_bytes(block_bytes(600)) == 2 * MiB  # small pool: a 2 MiB segment
    assert segment_bytes(5 * MiB) == 20 * MiB  # a large request under 10 MiB: 20 MiB
    assert segment_bytes(30 * MiB + 1) == 32 * MiB  # else the request rounded up to 2 MiB


def test_a_freed_block_is_reused_split_and_merged():
    stats = replay(_events(("+", 1, 100 * MiB), ("-", 1), ("+", 2, 50 * MiB), ("+", 3, 50 * MiB)))
    # 50 MiB is served from the cached 100 MiB segment (split: the 50 MiB rest is > 1 MiB), and
    # the second 50 MiB from its rest: nothing more is reserved
    assert stats.num_segments == 1
    assert stats.peak_reserved == 100 * MiB
    assert stats.peak_allocated == 100 * MiB
    stats = replay(_events(("+", 1, 100 * MiB), ("-", 1), ("+", 2, 60 * MiB), ("+", 3, 40 * MiB),
                           ("-", 2), ("-", 3), ("+", 4, 100 * MiB)))
    # 60 and 40 MiB split the cached segment; freed, they merge back into 100 MiB, which serves
    # the last request: one segment throughout
    assert stats.num_segments == 1 and stats.peak_reserved == 100 * MiB


def test_an_unsplit_remainder_counts_as_allocated():
    # 21 MiB reserves a 22 MiB segment; the 1 MiB rest is not > 1 MiB, so the block stays whole
    # and max_memory_allocated counts 22 MiB
    stats = replay(_events(("+", 1, 21 * MiB)))
    assert stats.peak_allocated == 22 * MiB == stats.peak_reserved
    # a small request leaves any rest of >= 512 bytes in the pool's 2 MiB segment
    stats = replay(_events(("+", 1, 1000), ("+", 2, 1000)))
    assert stats.peak_allocated == 2048 and stats.num_segments == 1


def test_at_capacity_cached_segments_are_released_before_an_oom():
    ops = (("+", 1, 60 * MiB), ("-", 1), ("+", 2, 80 * MiB))
    # the free 60 MiB segment is too small for 80 MiB: released, then the 80 MiB fits in 100
    stats = replay(_events(*ops), capacity=100 * MiB)
    assert stats.oom is None and stats.peak_reserved == 80 * MiB
    # held, it cannot be released: the request is refused, and says what it asked
    stats = replay(_events(("+", 1, 60 * MiB), ("+", 2, 80 * MiB)), capacity=100 * MiB)
    assert stats.oom["requested"] == 80 * MiB and stats.oom["allocated"] == 60 * MiB
