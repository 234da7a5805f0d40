"""What one chunk's op costs depend on, on one of its CP ranks (Work), from its segments
(chunk_work): tokens, attention pairs as the kernels compute them (perfmodel/pairs.py), a
dependent chunk's K/V state, and under ChunkFlow's CP the K/V it gathers or passes around the
ring and the tokens it holds whole (the hybrid placement, core/cp_place.py). perfmodel/layer.py
turns a Work into seconds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from megatron_chunkflow.core.cp_place import SPLIT, place_segments
from megatron_chunkflow.core.types import DataChunk
from megatron_chunkflow.perfmodel.pairs import (
    computed_pairs,
    gather_extent,
    piece_pairs,
    zigzag_pairs,
    zigzag_split_pairs,
)


class Work(NamedTuple):
    """What a chunk's op costs depend on, on one of its CP ranks."""

    tokens: int  # computed tokens (padding included) on this GPU
    pairs: float  # computed attention pairs on this GPU
    prefix: int = 0  # ChunkFlow: K/V tokens of the earlier chunks it attends to (read in place)
    prior: int = 0  # ChunkFlow: earlier chunks whose rows of the fp32 accumulator it updates
    relayed: bool = False  # ChunkFlow: its own accumulator is added to its gradient
    gathered: int = 0  # ChunkFlow under CP: K/V tokens all-gathered per layer (prefix + chunk)
    selected: int = 0  # ChunkFlow under CP: K/V rows this rank's pieces read (the selection)
    replicated: bool = False  # ChunkFlow under CP, replicated state: `gathered` is the chunk's own
    ring: bool = False  # ChunkFlow under CP: the ring attention (else gathered first)
    whole: int = 0  # ChunkFlow under hybrid CP: `tokens` in segments held whole (attended here)
    whole_pairs: float = 0.0  # ... and the busiest rank's pairs of them (the rest: the ring's)


def chunk_work(chunk: DataChunk, block: int, cp: int = 1, gather: bool | str = False,
               multiple: int = 1, placement: str = "hybrid") -> Work:
    """Work of a chunk on one of its CP ranks: computed tokens and pairs (a segment's padding is
    attended as part of it), and a dependent chunk's K/V state. `gather`: ChunkFlow's CP
    (all-gathered K/V, zigzag pieces, segments padded to 2 x CP: predict.cp_padded_lengths), its
    K/V state sharded (True or "sharded") or "replicated" (a dependent chunk gathers only its own
    K/V); else Megatron's ring. Under ChunkFlow's CP a standalone chunk's `placement` "hybrid"
    keeps segments whole on one rank as core/cp_place.py places them (each rank's tokens a
    multiple of `multiple`: TP under sequence parallelism): the ranks attend their whole segments
    first (the busiest rank's pairs), then the split ones (the busiest rank's pieces)."""
    dep, prefix = chunk.is_dependent, chunk.prefix_len
    state = (prefix, chunk.index, chunk.index < chunk.num_siblings - 1) if dep else (0, 0, False)
    if gather and cp > 1:
        replicated = dep and gather == "replicated"
        lengths = [s.computed_tokens for s in chunk.segments]
        placed = (place_segments(lengths, cp, multiple)
                  if placement == "hybrid" and not dep else None)
        owners = placed.owners if placed else (SPLIT,) * len(lengths)
        per_rank, whole = [0.0] * cp, [0.0] * cp
        for n, o in zip(lengths + list(placed.padding if placed else ()),
                        list(owners) + list(range(cp))):
            if o != SPLIT:  # a whole segment (or a rank's padding), attended on its rank alone
                whole[o] += piece_pairs(0, n, block)
                continue
            assert n % (2 * cp) == 0, "segments are padded to 2 x CP"
            if replicated:
                for r, pairs in enumerate(zigzag_pairs(prefix, n, block, cp)):
                    per_rank[r] += pairs
                continue
            for r, (mine, others) in enumerate(zigzag_split_pairs(prefix, n, block, cp)):
                per_rank[r] += mine + others
        split = sum(n for n, o in zip(lengths, owners) if o == SPLIT)
        gathered, selected = gather_extent(prefix, split, cp)
        tokens = placed.local_tokens if placed else chunk.computed_tokens // cp
        # the ranks attend their whole segments, then meet in the ring over the split ones
        return Work(tokens, max(whole) + max(per_rank), *state,
                    chunk.computed_tokens if replicated else gathered, selected, replicated,
                    not replicated and split > 0, tokens - split // cp, max(whole))
    pairs = sum(computed_pairs(prefix, s.computed_tokens, block, cp) for s in chunk.segments)
    return Work(math.ceil(chunk.computed_tokens / cp), pairs / cp, *state)
