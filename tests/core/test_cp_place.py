"""core/cp_place.py: the hybrid placement of a packed chunk's segments over CP ranks."""

import random

import pytest

from megatron_chunkflow.core.cp_place import SLACK, SPLIT, place_segments


def _check(lengths, cp, multiple, placed):
    """Every rank the same tokens, each segment held whole by one rank or split over all, the
    padding within SLACK; returns each rank's (whole, split share, padding) tokens."""
    shared = sum(n for n, o in zip(lengths, placed.owners) if o == SPLIT) // cp
    whole = [sum(n for n, o in zip(lengths, placed.owners) if o == r) for r in range(cp)]
    assert len(placed.owners) == len(lengths) and len(placed.padding) == cp
    assert all(o == SPLIT or 0 <= o < cp for o in placed.owners)
    assert [w + shared + p for w, p in zip(whole, placed.padding)] == [placed.local_tokens] * cp
    assert placed.local_tokens % max(2, multiple) == 0 and min(placed.padding) >= 0
    assert sum(placed.padding) <= SLACK * sum(whole)
    assert placed.local_tokens * cp == sum(lengths) + sum(placed.padding)  # nothing lost
    return whole, shared


def test_short_segments_stay_whole_and_a_long_one_is_split():
    lengths = (100, 24, 20, 16, 12, 8, 4)  # CP 2: 100 > 184 / 2 is split, the rest 44 | 40
    placed = place_segments(lengths, 2)
    assert placed.owners == (SPLIT, 0, 1, 1, 0, 0, 1) and placed.padding == (0, 4)
    assert _check(lengths, 2, 1, placed) == ([44, 40], 50)


def test_padding_is_weighed_against_the_tokens_kept_whole():
    # 28 split, 16 | 12 + 8 would pad rank 0 by 4 to keep 36 tokens whole (> 36 / 16): 16,
    # then 12 split in turn, and 8 alone cannot balance: the chunk keeps the zigzag layout
    assert place_segments((28, 16, 12, 8), 2) is None
    # 60 | 44 + 20 + 4: all whole, no padding, nothing to send
    assert place_segments((60, 44, 20, 4), 2).owners == (0, 1, 1, 0)


def test_equal_segments_spread_without_padding():
    placed = place_segments((8,) * 8, 4)
    assert sorted(placed.owners) == [0, 0, 1, 1, 2, 2, 3, 3] and placed.padding == (0,) * 4


def test_the_longest_placed_segment_is_split_when_padding_would_exceed_the_slack():
    # 24 | 20 + 16 leaves rank 0 12 short of 36 (> 60 / 16); splitting 24 then 20 leaves 16
    # alone on one rank: nothing can be placed
    assert place_segments((24, 20, 16), 2) is None
    # with a fourth segment the split of 24 balances 20 | 16 + 4
    placed = place_segments((24, 20, 16, 4), 2)
    assert placed.owners == (SPLIT, 0, 1, 1) and placed.padding == (0, 0)


def test_one_segment_is_always_split():
    assert place_segments((64,), 2) is None


def test_the_ranks_tokens_split_over_tp_under_sequence_parallelism():
    placed = place_segments((12, 8, 4, 4, 4), 2, multiple=4)
    _check((12, 8, 4, 4, 4), 2, 4, placed)


def test_a_split_segment_that_cannot_be_cut_is_refused():
    with pytest.raises(ValueError, match="segment 0 has 30 tokens, which do not cut into 2 x CP"):
        place_segments((30, 4, 4), 2)
    with pytest.raises(ValueError, match="CP >= 2"):
        place_segments((4, 4), 1)


@pytest.mark.parametrize("seed", range(30))
def test_random_chunks_keep_every_invariant(seed):
    rng = random.Random(seed)
    cp = rng.choice([2, 4, 8])
    multiple = rng.choice([1, 2, 4])
    lengths = [2 * cp * rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
    placed = place_segments(lengths, cp, multiple)
    if placed is not None:
        _check(lengths, cp, multiple, placed)
    assert place_segments(lengths, cp, multiple) == placed  # the same on every rank
