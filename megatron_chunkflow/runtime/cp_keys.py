"""Which keys each query piece of a CP rank reads under ChunkFlow's context parallelism
(runtime/cp.py): the zigzag shards a rank holds, and the rows of the gathered K/V its pieces
select, in one list (key_selection) or split into the rank's own and the others'
(ring_selection, for the ring attention). Host-side index arithmetic, cached per chunk
shape.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from megatron_chunkflow.core.cp_place import SPLIT


def shard_ranges(cu_seqlens, cp: int, rank: int, owners=()) -> list[tuple[int, int]]:
    """The [lo, hi) token ranges of a chunk with segment boundaries `cu_seqlens` that CP rank
    `rank` holds, in its local order: under a hybrid placement (`owners`, core/cp_place.py) the
    segments it holds whole first, then of every split segment (all of them without `owners`)
    pieces rank and 2 cp - 1 - rank."""
    bounds = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
    owners = owners or (SPLIT,) * len(bounds)
    out = [(a, b) for (a, b), o in zip(bounds, owners) if o == rank]
    for (a, b), o in zip(bounds, owners):
        if o != SPLIT:
            continue
        if (b - a) % (2 * cp):
            raise ValueError(f"segment [{a}, {b}) has {b - a} tokens, which do not cut into "
                             f"2 x CP = {2 * cp} equal pieces (core/packer pads segments)")
        piece = (b - a) // (2 * cp)
        out += [(a + i * piece, a + (i + 1) * piece) for i in (rank, 2 * cp - 1 - rank)]
    return out


@lru_cache(maxsize=8)  # the inputs and every stage's RoPE ask for the chunk being run
def local_index(cu_seqlens: tuple[int, ...], cp: int, rank: int,
                owners: tuple[int, ...] = ()) -> torch.Tensor:
    """Indices (into the whole chunk) of the tokens CP rank `rank` holds, in its local order
    (shared: read, never written)."""
    ranges = shard_ranges(cu_seqlens, cp, rank, owners)
    return torch.cat([torch.arange(lo, hi) for lo, hi in ranges] or [torch.zeros(0, dtype=torch.long)])


@lru_cache(maxsize=8)
def hybrid_cu(cu_seqlens: tuple[int, ...], owners: tuple[int, ...],
              rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Under a hybrid placement: the boundaries of the segments rank `rank` holds whole (its
    first local tokens, attended on their own) and of the split segments (a chunk of their own
    for the CP attention), each packed from 0."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    local, split = [0], [0]
    for n, o in zip(lengths, owners):
        if o == rank:
            local.append(local[-1] + n)
        elif o == SPLIT:
            split.append(split[-1] + n)
    return tuple(local), tuple(split)


class KeySelection(NamedTuple):
    """Which rows of a chunk's gathered K/V (prefix included) one CP rank's query pieces read."""

    index: torch.Tensor  # rows of the gathered K/V the pieces read, piece after piece
    cu_q: tuple[int, ...]  # the local queries cut into pieces (the kernel's segments)
    cu_kv: tuple[int, ...]  # each piece's keys within `index`


def _gathered_rows(cu_seqlens, prefix_chunks: int, chunk_size: int, cp: int,
                   replicated: bool) -> torch.Tensor:
    """row[p]: the row of the gathered K/V that holds position p of [prefix ++ chunk]."""
    blocks = [((0, chunk_size), i * chunk_size) for i in range(prefix_chunks)]
    blocks.append((cu_seqlens, prefix_chunks * chunk_size))
    order = ([(r, b) for b in blocks for r in range(cp)] if replicated
             else [(r, b) for r in range(cp) for b in blocks])
    natural = torch.cat([torch.arange(offset + lo, offset + hi)  # each row's position
                         for r, (cu, offset) in order for lo, hi in shard_ranges(cu, cp, r)])
    row = torch.empty_like(natural)
    row[natural] = torch.arange(natural.numel())
    return row


def _pieces(cu_seqlens, prefix: int, cp: int, rank: int):
    """(lo, hi, first) of this rank's query pieces: a piece sees its segment's keys from `first`
    (0 in a dependent chunk: the whole prefix) up to its own end, prefix + hi."""
    if prefix and len(cu_seqlens) != 2:
        raise ValueError("a dependent chunk has one segment")
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        for lo, hi in shard_ranges((a, b), cp, rank):
            yield lo, hi, 0 if prefix else a


@lru_cache(maxsize=8)  # host memory: a late chunk's index lists its whole prefix twice
def key_selection(cu_seqlens: tuple[int, ...], prefix_chunks: int, chunk_size: int, cp: int,
                  rank: int, replicated: bool = False) -> KeySelection:
    """The key selection for a chunk with segment boundaries `cu_seqlens` after `prefix_chunks`
    earlier chunks of `chunk_size` tokens (a dependent chunk: one segment), on CP rank `rank`, on
    the host (runtime/model.py keeps the device copy for one forward).

    Rows of the K/V it indexes: sharded state (the default), rank after rank, each rank's shards of
    the prefix chunks and then of this chunk (the rows runtime/state.py's buffer holds, then
    gathered); `replicated` state, chunk after chunk, each chunk's shards rank after rank (each
    chunk's K/V gathered once, then written into the buffer by the relay)."""
    prefix = prefix_chunks * chunk_size
    row = _gathered_rows(cu_seqlens, prefix_chunks, chunk_size, cp, replicated)
    rows, cu_q, cu_kv = [], [0], [0]
    for lo, hi, first in _pieces(cu_seqlens, prefix, cp, rank):
        rows.append(row[first:prefix + hi])
        cu_q.append(cu_q[-1] + hi - lo)
        cu_kv.append(cu_kv[-1] + prefix + hi - first)
    return KeySelection(torch.cat(rows), tuple(cu_q), tuple(cu_kv))


class BlockKeys(NamedTuple):
    """The keys of one rank's K/V block (its shards of [prefix ++ chunk]) that this rank's query
    pieces read: `keys` indexes the block, for the query rows `rows` (the pieces that read any
    of it), as the kernel's segments."""

    keys: KeySelection
    rows: torch.Tensor


class RingSelection(NamedTuple):
    """The ring attention's keys (sharded state), one BlockKeys per step s = 0 .. CP - 1: the
    block of rank (rank - s) mod CP. Step 0 is the rank's own block, read bottom-right causally
    (each piece's own keys last); every other block holds only keys before the pieces that read
    it, read without a mask."""

    blocks: tuple[BlockKeys, ...]


@lru_cache(maxsize=8)
def ring_selection(cu_seqlens: tuple[int, ...], prefix_chunks: int, chunk_size: int, cp: int,
                   rank: int) -> RingSelection:
    """key_selection's keys of each local query piece, split by the rank that holds them, in
    the order a ring brings the blocks (own first, then the previous rank's, ...)."""
    prefix = prefix_chunks * chunk_size
    row = _gathered_rows(cu_seqlens, prefix_chunks, chunk_size, cp, False)
    held = row.numel() // cp  # every rank holds as many rows: rank j's are [j held, (j+1) held)
    pieces = list(_pieces(cu_seqlens, prefix, cp, rank))
    starts = [0]
    for lo, hi, _ in pieces:
        starts.append(starts[-1] + hi - lo)
    empty = torch.zeros(0, dtype=torch.long)
    blocks = []
    for step in range(cp):
        j = (rank - step) % cp
        index, rows, cu_q, cu_kv = [], [], [0], [0]
        for (lo, hi, first), q0, q1 in zip(pieces, starts[:-1], starts[1:]):
            keys = row[first:prefix + hi]
            keys = keys[(keys >= j * held) & (keys < (j + 1) * held)] - j * held
            if keys.numel():
                index.append(keys)
                rows.append(torch.arange(q0, q1))
                cu_q.append(cu_q[-1] + q1 - q0)
                cu_kv.append(cu_kv[-1] + keys.numel())
        blocks.append(BlockKeys(KeySelection(torch.cat(index or [empty]), tuple(cu_q),
                                             tuple(cu_kv)), torch.cat(rows or [empty])))
    return RingSelection(tuple(blocks))
