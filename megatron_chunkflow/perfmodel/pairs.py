"""Attention pairs and tiles per segment, as the kernels compute them (whole block x block tiles,
bottom-right causal after a prefix), for Megatron's CP split of whole sequences and ChunkFlow's
zigzag pieces after a prefix; and the K/V rows ChunkFlow's CP attention gathers and selects.
perfmodel/layer.py turns them into seconds.
"""

from __future__ import annotations

import math
from functools import lru_cache

from megatron_chunkflow.core.costs import attention_pairs


def attention_tiles(prefix: int, num_q: int, block: int) -> int:
    """block x block tiles a causal, bottom-right-aligned kernel computes for `num_q` queries
    after `prefix` keys: query block i sees ceil((prefix + min((i+1) block, q)) / block)."""
    nq = math.ceil(num_q / block)
    return ((nq - 1) * math.ceil(prefix / block) + (nq - 1) * nq // 2
            + math.ceil((prefix + num_q) / block))


def piece_pairs(prefix: int, num_q: int, block: int) -> float:
    """(query, key) pairs a causal, bottom-right-aligned kernel computes for `num_q` queries
    after `prefix` keys, whole block x block tiles (exact pairs when block is 0)."""
    if block == 0:
        return float(attention_pairs(prefix, num_q))
    return float(attention_tiles(prefix, num_q, block) * block * block)


@lru_cache(maxsize=65536)
def zigzag_pairs(prefix: int, num_q: int, block: int, cp: int) -> tuple[float, ...]:
    """Per CP rank, the pairs ChunkFlow's CP attention computes for one segment of `num_q`
    tokens (a multiple of 2*CP) after `prefix` keys of its sequence: rank r's pieces r and
    2*CP-1-r, each attending to the prefix and its segment up to the piece's end."""
    piece = num_q // (2 * cp)
    return tuple(piece_pairs(prefix + r * piece, piece, block)
                 + piece_pairs(prefix + (2 * cp - 1 - r) * piece, piece, block)
                 for r in range(cp))


def computed_pairs(prefix: int, num_q: int, block: int, cp: int = 1) -> float:
    """(query, key) pairs the kernel computes for one segment, tiles included, summed over the CP
    ranks: with CP the segment is cut into 2*CP pieces and every (piece, earlier piece) pair
    is a full block, every piece with itself a causal one."""
    if block == 0 or cp == 1:
        return piece_pairs(prefix, num_q, block)
    assert prefix == 0, "Megatron's CP splits whole sequences only"
    pieces = 2 * cp
    piece = math.ceil(num_q / pieces)
    full = pieces * (pieces - 1) // 2 * math.ceil(piece / block) ** 2
    return float((full + pieces * attention_tiles(0, piece, block)) * block * block)


def gather_extent(prefix: int, tokens: int, cp: int) -> tuple[int, int]:
    """(gathered, selected) K/V tokens of ChunkFlow's CP attention for a chunk of `tokens` split
    tokens (its segments cut over the CP ranks; a dependent chunk's one) after `prefix` keys
    (runtime/cp.py): the whole [prefix ++ chunk], and the rows a rank's two pieces of each
    segment read, the prefix and the segment up to the piece's end: 2 prefix + (2 CP + 1) /
    (2 CP) x segment (the same on every rank; a dependent chunk has one segment)."""
    if not tokens:
        return 0, 0
    return prefix + tokens, 2 * prefix + tokens + tokens // (2 * cp)


@lru_cache(maxsize=65536)
def zigzag_split_pairs(prefix: int, num_q: int, block: int, cp: int) -> tuple[tuple[float,
                                                                                 float], ...]:
    """Per CP rank, (own, others) pairs of ChunkFlow's ring CP attention for one segment of
    `num_q` tokens after `prefix` keys (sharded state: the rank holds prefix / CP of them):
    each piece attends causally to the keys the rank holds (its prefix shards, its earlier piece,
    itself), and without a mask to the other ranks' keys before it (whole block x block tiles;
    counted as one call, where the ring makes CP - 1)."""
    piece, own_prefix = num_q // (2 * cp), prefix // cp
    out = []
    for r in range(cp):
        own = (piece_pairs(own_prefix, piece, block)  # piece r: no earlier piece of its own
               + piece_pairs(own_prefix + piece, piece, block))  # piece 2 cp - 1 - r: after r
        others = sum(_full_pairs(piece, prefix - own_prefix + before * piece, block)
                     for before in (r, 2 * cp - 2 - r))
        out.append((own, others))
    return tuple(out)


def _full_pairs(num_q: int, num_k: int, block: int) -> float:
    """Pairs of a non-causal kernel over num_q queries and num_k keys, whole tiles."""
    if block == 0:
        return float(num_q * num_k)
    return float(math.ceil(num_q / block) * math.ceil(num_k / block) * block * block)
