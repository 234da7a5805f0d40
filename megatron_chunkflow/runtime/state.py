"""The K/V state of long sequences and the gradient relay between their data chunks.

Shapes (THD, per TP rank): k, v [t, ng, hn]; a dependent chunk's attention reads K_0, ..., K_{j-1},
K_j one after another along t, where K_i are the post-RoPE keys of earlier chunks i < j of the same
sequence (already rotated, never re-rotated).

The buffer. A sequence's K/V of one layer live in one tensor [2, L_t, ...] (K, V; the L tokens of
its N chunks as they reach this layer: whole, or 1/CP per rank; chunks of C_t = C or C / CP tokens
but the last), allocated by chunk 0's first forward. Chunk j's first forward writes its own K/V into
rows [j C_t, j C_t + own) in place and its attention reads the view of rows [0, j C_t + own): no
concatenation and no copy of the prefix per chunk. Rows are written once and never change while any
view of them is saved: the writes go through a second tensor over the same storage (its own version
counter), so a later chunk's write does not invalidate an earlier chunk's saved view of rows before
it.

The relay (docs/design.md). The stored K/V are *detached*: a later chunk's forward reads them
without a graph edge back into chunk j. `_ChunkKV` is the autograd Function that glues it together:
- forward: writes the own k/v into the buffer on the chunk's first forward (a re-forward, or a
  recompute inside the backward, writes nothing: the rows hold the first values) and returns the
  view of the prefix and its own rows;
- backward: the prefix part of the incoming gradient is added, in one add per K and V, to the
  sequence's fp32 accumulator (one tensor over the prefix of the first chunk back-propagated,
  h C_t rows for the highest such chunk h: N - 1 without SpaCO); the own part gets
  this chunk's rows of the accumulator added (the gradient later chunks sent it).
Backward runs in descending chunk order, so a chunk's rows of the accumulator are complete when its
backward reads them. There are no extra backward roots: Megatron's backward_step works unchanged.

Freeing: the buffer and the accumulator stay until the sequence's last reader is done, the backward
of its lowest back-propagated chunk (chunk 0 without SpaCO), which drops both: the state's peak, L_t
K/V rows plus (N-1) C_t accumulator rows (without SpaCO), is reached at the first backward and held
to the last (docs/exactness.md, "Memory").

Under context parallelism (runtime/cp.py) k, v and everything stored or accumulated here are this CP
rank's shard of each chunk; the rows K_0, ..., K_j are then this rank's shards, which the attention
all-gathers, and the gradient it returns is this rank's shard of dK/dV (reduce-scattered). With
replicated state (ChunkMeta.cp_kv) the chunk's K/V are gathered first, so k, v, the stored K/V and
the accumulator are whole chunks on every CP rank; the accumulator then holds this rank's queries'
share of the gradient, and the reduce-scatter after the relay sums the shares.

SpaCO (runtime/sparse.py, docs/sparse.md): a chunk in `meta.dropped` runs forward only.
Its rows of the accumulator are never read (the gradient that would reach its K/V is cut); the
state is dropped by the backward of the lowest back-propagated chunk, or, when no chunk of the
sequence is back-propagated, by the last chunk's forward.
A back-propagated chunk's whole backward is scaled by `meta.grad_weight` (1 / its inclusion
probability): its loss by the schedule, the gradient relayed into its K/V here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_chunkflow.runtime.cp_comm import Traffic


class Kept(NamedTuple):
    """One layer's attention of a re-forwarded chunk, kept from its first forward: the output
    [t, np, hn] and the backend's log-sum-exp, in host memory when `host` (offload)."""

    out: torch.Tensor
    lse: torch.Tensor
    host: bool = False


@dataclass(frozen=True)
class ChunkMeta:
    """What attention and RoPE need to know about the data chunk being run."""

    chunk_id: int
    cu_seqlens: tuple[int, ...]  # segment boundaries within the chunk
    position_ids: torch.Tensor  # [t] RoPE positions (continuing across a sequence's chunks)
    seq_id: int | None = None  # dependent chunks: the long sequence
    index: int = 0  # dependent chunks: position among the sequence's chunks
    num_siblings: int = 1
    chunk_size: int = 0  # tokens per dependent chunk (all but the last have exactly this many)
    seq_tokens: int = 0  # dependent chunks: the sequence's tokens over all its chunks (padding
    #                      included); 0 when unknown: its K/V buffer then holds N whole chunks
    num_padding: int = 0  # trailing padding tokens (a segment of their own; sequence parallelism)
    grad_weight: float = 1.0  # SpaCO: this chunk's backward is scaled by this (1 / inclusion prob.)
    dropped: frozenset[int] = frozenset()  # SpaCO: indices of this sequence's forward-only chunks
    cp_size: int = 1  # context parallelism: this rank holds 1/cp_size of the chunk (runtime/cp.py)
    cp_rank: int = 0
    cp_kv: str = "sharded"  # dependent chunks under CP: "replicated" keeps the whole prefix here
    cp_attention: str = "ring"  # under CP: K/V blocks passed around a ring behind the kernel
    cp_owners: tuple[int, ...] = ()  # hybrid CP: per segment, the rank holding it whole or -1
    reforward_attention: str = "recompute"  # re-forwarded chunks: "keep", "offload" (reforward.py)
    # per sequence segment (the first len() segments of cu_seqlens; the rest are padding): the
    # padding at its end (context parallelism's 2 x CP pieces), part of no sequence
    segment_padding: tuple[int, ...] = ()

    @property
    def dependent(self) -> bool:
        return self.seq_id is not None

    @property
    def num_tokens(self) -> int:
        """The chunk's tokens (padding included), over all its CP ranks."""
        return self.cu_seqlens[-1]

    @property
    def local_tokens(self) -> int:
        """The chunk's tokens on this CP rank."""
        return self.cu_seqlens[-1] // self.cp_size

    @property
    def prefix_len(self) -> int:
        return self.index * self.chunk_size if self.dependent else 0


class _SequenceKV:
    """One layer's K/V of one long sequence (the module docstring): `kv` [2, L_t, ...],
    written through `writer` (the same storage, its own version counter); `acc` the fp32 (fp64 in
    fp64 runs) gradient accumulator over the prefix of the first chunk back-propagated."""

    __slots__ = ("kv", "writer", "stride", "acc", "written")

    def __init__(self, k: torch.Tensor, meta: ChunkMeta):
        self.stride = k.size(0)  # C, C / CP (sharded), as chunk 0 reaches this layer
        rows = (meta.seq_tokens * self.stride // meta.num_tokens if meta.seq_tokens
                else meta.num_siblings * self.stride)
        self.kv = k.new_empty((2, rows, *k.shape[1:]))
        self.writer = k.new_empty(0).set_(self.kv.untyped_storage(), self.kv.storage_offset(),
                                          self.kv.shape, self.kv.stride())
        self.acc: torch.Tensor | None = None
        self.written = 0  # rows written: chunks write theirs once, in order

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.acc) if t is not None)


class KVStateStore:
    """Per (layer_number, seq_id): the sequence's K/V buffer, written in place by its chunks, and
    their gradient accumulator in fp32 (fp64 when training in fp64)."""

    def __init__(self):
        self.current: ChunkMeta | None = None
        self.reforward = False
        self._kv: dict[tuple[int, int], _SequenceKV] = {}
        self.storages: set[int] = set()  # the K/V buffers' storages (runtime/meter.py: state)
        self.cp_traffic = Traffic()  # context parallelism: bytes this rank's K/V collectives move
        self.cp_keys = None  # runtime/cp.py's key selection of the chunk being run
        self.keeping = False  # this forward keeps its attention for the re-forward (reforward.py)
        # (seq, index) -> layer -> Kept: re-forwarded chunks' attention (runtime/reforward.py)
        self._attention: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.version = 0  # bumped when kept attention changes (runtime/meter.py re-reads nbytes)
        self.balance = None  # MoE: runtime/moe.py SequenceBalance (the balancing loss)

    # ---- chunk context (set by the schedule around each forward) --------------------------------
    def begin(self, meta: ChunkMeta, reforward: bool = False, keep_attention: bool = False) -> None:
        """Enter a chunk's forward; a re-forward reads the state but stores nothing.
        `keep_attention`: the first forward of a chunk re-forwarded later, under
        meta.reforward_attention keep or offload: its attention output is kept for the re-forward
        (runtime/reforward.py)."""
        assert self.current is None, "nested data chunk forwards"
        self.current = meta
        self.reforward = reforward
        self.keeping = keep_attention
        self.cp_keys = None  # runtime/cp.py's key selection of this chunk, built by its first layer

    def end(self) -> None:
        self.current = None
        self.keeping = False

    # ---- kept attention (runtime/reforward.py) --------------------------------------------------
    def keep_attention(self, layer: int, kept: Kept) -> None:
        meta = self.current
        self._attention.setdefault((meta.seq_id, meta.index), {})[layer] = kept
        self.version += 1

    def kept_attention(self, layer: int, release: bool) -> Kept:
        """The current chunk's kept attention of `layer`; `release`: handed over (to the graph of
        the re-forward whose backward reads it), no longer held here."""
        meta = self.current
        layers = self._attention.get((meta.seq_id, meta.index), {})
        if layer not in layers:
            raise RuntimeError(f"no kept attention for layer {layer} of chunk {meta.index} of "
                               f"sequence {meta.seq_id}: its first forward did not keep it")
        if not release:
            return layers[layer]
        self.version += 1
        return layers.pop(layer)

    def release_attention(self, meta: ChunkMeta) -> None:
        """After the chunk's backward on this stage: drop what no re-forward took."""
        if self._attention.pop((meta.seq_id, meta.index), None) is not None:
            self.version += 1

    # ---- the relay ------------------------------------------------------------------------------
    def kv_with_state(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """For the current dependent chunk: (K, V) of its prefix and its own tokens, relayed."""
        meta = self.current
        assert meta is not None and meta.dependent
        return _ChunkKV.apply(self, layer, meta, k, v)

    def _sequence(self, layer: int, meta: ChunkMeta, k: torch.Tensor) -> _SequenceKV:
        key = (layer, meta.seq_id)
        entry = self._kv.get(key)
        if entry is None:
            if meta.index or self.reforward:
                raise RuntimeError(f"no stored K/V for layer {layer} of sequence {meta.seq_id}: "
                                   f"chunk {meta.index} ran before the sequence's chunk 0")
            entry = self._kv[key] = _SequenceKV(k, meta)
            self.storages.add(entry.kv.untyped_storage().data_ptr())
        lo = meta.index * entry.stride
        if lo + k.size(0) > entry.kv.size(1) or (meta.index + 1 < meta.num_siblings
                                                 and k.size(0) != entry.stride):
            raise RuntimeError(f"chunk {meta.index} of sequence {meta.seq_id} has {k.size(0)} "
                               f"tokens here, its chunk 0 {entry.stride}: only the last chunk "
                               "may be shorter")
        # rows under a saved view must never change (the writes bypass autograd's version check)
        if not self.reforward and lo != entry.written:
            raise RuntimeError(f"chunk {meta.index} of sequence {meta.seq_id} ran its first "
                               f"forward out of order in layer {layer} (rows [{lo}, ...) with "
                               f"{entry.written} written): the K/V state was not cleared")
        return entry

    def _drop(self, key) -> None:
        entry = self._kv.pop(key, None)
        if entry is not None:
            self.storages.discard(entry.kv.untyped_storage().data_ptr())

    # ---- bookkeeping ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held now on the model's device: stored K/V, gradient accumulators and kept
        attention (not what `offload` keeps in host memory: kept_host_bytes)."""
        return sum(e.nbytes() for e in self._kv.values()) + self._kept_bytes(host=False)

    def kept_host_bytes(self) -> int:
        """Bytes of attention kept in host memory (--chunkflow-reforward-attention offload)."""
        return self._kept_bytes(host=True)

    def _kept_bytes(self, host: bool) -> int:
        return sum(t.numel() * t.element_size() for layers in self._attention.values()
                   for kept in layers.values() if kept.host == host for t in kept[:2])

    def is_empty(self) -> bool:
        return not self._kv and not self._attention

    def clear(self) -> None:
        """Drop everything (after a forward-only pass, or to recover from an error)."""
        self._kv.clear()
        self.storages.clear()
        self._attention.clear()
        self.version += 1
        self.current = None
        self.keeping = False


class _ChunkKV(torch.autograd.Function):
    """Identity on the chunk's own K/V, returned after its sequence's stored prefix (one view of
    the sequence's buffer)."""

    @staticmethod
    def forward(ctx, store, layer, meta, k, v):
        entry = store._sequence(layer, meta, k)
        lo, index, dropped = meta.index * entry.stride, meta.index, meta.dropped
        hi = lo + k.size(0)
        if not store.reforward:
            entry.writer[0, lo:hi].copy_(k)
            entry.writer[1, lo:hi].copy_(v)
            entry.written = hi
        # the lowest back-propagated chunk: the sequence's last reader (O(1) without SpaCO)
        lowest = next((j for j in range(meta.num_siblings) if j not in dropped), None)
        if lowest is None and index + 1 == meta.num_siblings and not store.reforward:
            store._drop((layer, meta.seq_id))  # SpaCO: no chunk of it back-propagated
        ctx.store, ctx.key, ctx.index, ctx.stride = store, (layer, meta.seq_id), index, entry.stride
        ctx.weight, ctx.last_reader = meta.grad_weight, index == lowest
        return entry.kv[0, :hi], entry.kv[1, :hi]

    @staticmethod
    def backward(ctx, gk_all, gv_all):
        store = ctx.store
        entry = store._kv[ctx.key]
        p = ctx.index * ctx.stride
        if p:
            if entry.acc is None:  # the first chunk back-propagated: its prefix is the largest
                dtype = torch.float64 if gk_all.dtype == torch.float64 else torch.float32
                entry.acc = gk_all.new_zeros((2, p, *gk_all.shape[1:]), dtype=dtype)
            entry.acc[0, :p].add_(gk_all[:p])
            entry.acc[1, :p].add_(gv_all[:p])
        gk, gv = gk_all[p:], gv_all[p:]
        if entry.acc is not None and p < entry.acc.size(1):  # what later chunks sent it
            w, n = ctx.weight, gk.size(0)
            relayed = entry.acc[:, p:p + n].to(gk.dtype)
            gk = gk + (relayed[0] if w == 1 else relayed[0] * w)
            gv = gv + (relayed[1] if w == 1 else relayed[1] * w)
        if ctx.last_reader:
            store._drop(ctx.key)
        return None, None, None, gk, gv
