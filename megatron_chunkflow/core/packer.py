"""Chunk construction (ChunkFlow Algorithm 1) and distribution over data-parallel ranks.

1. Every sequence longer than `chunk_size` C is cut into ceil(L / C) dependent chunks, in order;
   the last one may be shorter. It is never back-filled: its queries attend to the whole sequence
   prefix, and mixing it with other sequences would only complicate the state bookkeeping.
2. Sequences of length <= C are bin-packed into standalone chunks of capacity C with best-fit
   decreasing (BFD): items sorted by decreasing length (ties by sequence id), each put into the
   fullest chunk it still fits in. Guarantees: every bin but at most one is more than half full, so
   num_standalone <= 2 * bins_lower_bound; and BFD <= 11/9 OPT + 4 (Johnson 1973). On long-tailed
   SFT lengths (items much smaller than C) it lands on the lower bound ceil(short tokens / C) or one
   above it; `scripts/benchmarks/bench_planner.py` measures this.
   The published algorithm retries with BinCnt = 1, 2, ... bins; BFD reaches the same or one more
   bin count in one O(n log n) pass, which keeps planning 100K sequences under a second.
3. Distribution over DP ranks: a long sequence's dependent chunks form one unit (they share state
   and must stay on one rank); each standalone chunk is a unit. Units are assigned
   longest-processing-time first to the least-loaded rank, where a unit's cost is its training
   FLOPs with attention counted per segment (a late dependent chunk costs ~C * prefix, not C * C)
   plus its re-forwards.

Everything is a deterministic function of the inputs, so every rank can rebuild the same chunks.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Sequence

from megatron_chunkflow.core.costs import chunk_flops
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.types import ChunkBatch, DataChunk, Segment

_BIN_BITS = 32  # BFD keys pack (remaining capacity, bin index) into one int for fast bisect


def validate_lengths(seq_lengths: Sequence[int]) -> None:
    if len(seq_lengths) == 0:
        raise ValueError("no sequences: the batch is empty")
    for i, n in enumerate(seq_lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"sequence {i} has length {n!r}; lengths must be positive integers")


def best_fit_decreasing(sizes: Sequence[int], ids: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (sizes[i] <= capacity) into bins of `capacity`; returns lists of ids per bin."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], ids[i]))
    bins: list[list[int]] = []
    keys: list[int] = []  # sorted: remaining << _BIN_BITS | bin index
    mask = (1 << _BIN_BITS) - 1
    for i in order:
        size = sizes[i]
        pos = bisect_left(keys, size << _BIN_BITS)
        if pos == len(keys):
            b, remaining = len(bins), capacity
            bins.append([])
        else:
            key = keys.pop(pos)
            b, remaining = key & mask, key >> _BIN_BITS
        bins[b].append(ids[i])
        insort(keys, ((remaining - size) << _BIN_BITS) | b)
    return bins


def first_fit(sizes: Sequence[int], ids: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items (sizes[i] <= capacity) in the given order, each into the first bin with room
    (the usual offline SFT pre-packing: Megatron-Bridge's / NeMo's first_fit_shuffle is this over
    shuffled data); returns lists of ids per bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for size, item in zip(sizes, ids):
        b = next((j for j, r in enumerate(room) if r >= size), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(item)
        room[b] -= size
    return bins


def split_long(seq_id: int, length: int, chunk_size: int, first_id: int,
               segment_multiple: int = 1) -> list[DataChunk]:
    n = math.ceil(length / chunk_size)
    last = length - (n - 1) * chunk_size  # the last chunk's tokens; the others have chunk_size
    return [
        DataChunk(
            id=first_id + j,
            kind="dependent",
            segments=(Segment(seq_id, j * chunk_size, min(length, (j + 1) * chunk_size),
                              -last % segment_multiple if j == n - 1 else 0),),
            parent=seq_id,
            index=j,
            num_siblings=n,
        )
        for j in range(n)
    ]


def distribute(units: list[list[DataChunk]], costs: list[float], num_ranks: int) -> list[int]:
    """Longest-processing-time first: returns the DP rank of each unit."""
    order = sorted(range(len(units)), key=lambda u: (-costs[u], units[u][0].id))
    loads = [(0.0, r) for r in range(num_ranks)]
    rank_of = [0] * len(units)
    for u in order:
        load, r = heapq.heappop(loads)
        rank_of[u] = r
        heapq.heappush(loads, (load + costs[u], r))
    return rank_of


def unit_cost(unit: list[DataChunk], shape: ModelShape, num_kept: int) -> float:
    """Training FLOPs of a unit: 3x forward, plus one more forward per re-forwarded chunk."""
    fwd = [chunk_flops(c, shape).forward(shape.num_layers) for c in unit]
    num_recomputed = max(0, len(unit) - num_kept) if unit[0].is_dependent else 0
    return 3.0 * sum(fwd) + sum(fwd[:num_recomputed])


def build_chunks(
    seq_lengths: Sequence[int],
    chunk_size: int,
    num_dp_ranks: int,
    num_kept: int,
    shape: ModelShape,
    segment_multiple: int = 1,
    chunk_multiple: int = 1,
) -> ChunkBatch:
    """Cut, pack and distribute one global batch over `num_dp_ranks`, balancing the ranks by the
    training FLOPs of `shape` with K chunks of a long sequence holding activations (unit_cost).
    Chunk ids: dependent chunks first (by sequence id, then index), then standalone chunks in
    packing order.

    `segment_multiple` (context parallelism: 2 x CP): every segment is padded at its end to a
    multiple of it (each short sequence, packed by its padded length), so that it cuts into
    2 x CP equal pieces; `chunk_multiple` (ParallelConfig.chunk_padding: 2 x CP x TP under
    sequence parallelism) then pads every chunk's last segment so that the chunk's tokens are a
    multiple of it (a sequence's last chunk: its one segment). The chunk size must be a multiple
    of both. The padding comes after the segment's tokens, so no real token attends to it."""
    validate_lengths(seq_lengths)
    if chunk_size < 1:
        raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
    if num_dp_ranks < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {num_dp_ranks}")
    if num_kept < 1:
        raise ValueError(f"K must be >= 1, got {num_kept}")
    for multiple in (segment_multiple, chunk_multiple):
        if multiple < 1 or chunk_size % multiple:
            raise ValueError(f"chunk size {chunk_size} is not a multiple of the padding multiple "
                             f"{multiple} (2 x the context-parallel size, x TP under sequence "
                             "parallelism)")

    units: list[list[DataChunk]] = []
    next_id = 0
    short_ids = []
    for seq_id, n in enumerate(seq_lengths):
        if n > chunk_size:
            units.append(split_long(seq_id, n, chunk_size, next_id,
                                    math.lcm(segment_multiple, chunk_multiple)))
            next_id += len(units[-1])
        else:
            short_ids.append(seq_id)
    short_sizes = [seq_lengths[i] for i in short_ids]
    padded = [n + -n % segment_multiple for n in short_sizes]
    for members in best_fit_decreasing(padded, short_ids, chunk_size):
        segments = [Segment(i, 0, seq_lengths[i], -seq_lengths[i] % segment_multiple)
                    for i in members]
        total = sum(s.computed_tokens for s in segments)
        if total % chunk_multiple:
            last = segments[-1]
            segments[-1] = dataclasses.replace(last, padding=last.padding - total % chunk_multiple
                                               + chunk_multiple)
        segments = tuple(segments)
        units.append([DataChunk(id=next_id, kind="standalone", segments=segments)])
        next_id += 1

    ranks = distribute(units, [unit_cost(u, shape, num_kept) for u in units], num_dp_ranks)
    chunks = tuple(dataclasses.replace(c, dp_rank=r) for u, r in zip(units, ranks) for c in u)
    return ChunkBatch(
        chunks=tuple(sorted(chunks, key=lambda c: c.id)),
        seq_lengths=tuple(seq_lengths),
        chunk_size=chunk_size,
        num_dp_ranks=num_dp_ranks,
        bins_lower_bound=math.ceil(sum(short_sizes) / chunk_size),
    )

