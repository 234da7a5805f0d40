"""The K/V state of long sequences and the gradient relay between their data chunks.

Shapes (THD, per TP rank): k, v [t, ng, hn]; a dependent chunk's attention reads
cat(K_0, ..., K_{j-1}, K_j) along t, where K_i are the post-RoPE keys of earlier chunks i < j of the
same sequence (already rotated, never re-rotated).

The relay (docs/design.md). Chunk j's K/V are stored *detached*: a later chunk's forward reads them
without a graph edge back into chunk j. `_ChunkKV` is the autograd Function that glues it together:
- forward: returns cat(stored prefix, own k/v) and, on the chunk's first forward, stores the own k/v
  for later chunks (a re-forward stores nothing: later chunks already read the first values);
- backward: the prefix part of the incoming gradient is added, in fp32, to each earlier chunk's
  accumulator; the own part gets this chunk's accumulator added (the gradient later chunks sent it).
Backward runs in descending chunk order, so an accumulator is complete when its chunk's backward
reads it. There are no extra backward roots: Megatron's backward_step works unchanged.

Freeing: chunk j's stored K/V are last read by the final forward of chunk j+1, so chunk j+1's backward
frees them; each backward frees its own accumulator. After chunk 0's backward nothing of the
sequence remains.

Under context parallelism (runtime/cp.py) k, v and everything stored or accumulated here are this
CP rank's shard of each chunk; cat(K_0, ..., K_j) is then this rank's shards, which the attention
all-gathers, and the gradient it returns is this rank's shard of dK/dV (reduce-scattered). With
replicated state (ChunkMeta.cp_kv) the chunk's K/V are gathered first, so k, v, the stored K/V and
the accumulators are whole chunks on every CP rank; an accumulator then holds this rank's queries'
share of the gradient, and the reduce-scatter after the relay sums the shares.

SpaCO (runtime/sparse.py, docs/sparse.md): a chunk in `meta.dropped` runs forward only.
Nothing accumulates for it (the gradient that would reach its K/V is cut); the backward of chunk j
frees the stored K/V of j-1 and of every chunk below it down to the next back-propagated one; the
forward of the last chunk, when it is dropped, frees the K/V that only dropped chunks still read.
A back-propagated chunk's whole backward is scaled by `meta.grad_weight` (1 / its inclusion
probability): its loss by the schedule, the gradient relayed into its K/V here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_chunkflow.runtime.cp import Traffic


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
    num_padding: int = 0  # trailing padding tokens (a segment of their own; sequence parallelism)
    grad_weight: float = 1.0  # SpaCO: this chunk's backward is scaled by this (1 / inclusion prob.)
    dropped: frozenset[int] = frozenset()  # SpaCO: indices of this sequence's forward-only chunks
    cp_size: int = 1  # context parallelism: this rank holds 1/cp_size of the chunk (runtime/cp.py)
    cp_rank: int = 0
    cp_kv: str = "sharded"  # dependent chunks under CP: "replicated" keeps the whole prefix here
    cp_attention: str = "ring"  # under CP: K/V blocks passed around a ring behind the kernel
    cp_owners: tuple[int, ...] = ()  # hybrid CP: per segment, the rank holding it whole or -1
    reforward_attention: str = "recompute"  # re-forwarded chunks: "keep", "offload" (reforward.py)

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


class KVStateStore:
    """Per (layer_number, seq_id, chunk index): detached K/V, and gradient accumulators in fp32
    (fp64 when training in fp64)."""

    def __init__(self):
        self.current: ChunkMeta | None = None
        self.reforward = False
        self._kv: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefix_copies: set[int] = set()  # storages of cat(prefix, own) made in this forward
        self.cp_traffic = Traffic()  # context parallelism: bytes this rank's K/V collectives move
        self.cp_keys = None  # runtime/cp.py's key selection of the chunk being run
        self.keeping = False  # this forward keeps its attention for the re-forward (reforward.py)
        # (seq, index) -> layer -> Kept: re-forwarded chunks' attention (runtime/reforward.py)
        self._attention: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.version = 0  # bumped when kept attention changes (runtime/meter.py re-reads nbytes)

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
        self.prefix_copies.clear()
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
        """For the current dependent chunk: (cat(prefix k, k), cat(prefix v, v)), relayed."""
        meta = self.current
        assert meta is not None and meta.dependent
        return _ChunkKV.apply(self, layer, meta, k, v)

    def _prefix(self, layer: int, seq: int, index: int):
        ks, vs = [], []
        for j in range(index):
            k, v = self._kv[(layer, seq, j)]
            ks.append(k)
            vs.append(v)
        return ks, vs

    def _accumulate(self, key, gk: torch.Tensor, gv: torch.Tensor) -> None:
        acc = self._grad.get(key)
        if acc is None:
            dtype = torch.float64 if gk.dtype == torch.float64 else torch.float32
            self._grad[key] = (gk.to(dtype, copy=True), gv.to(dtype, copy=True))
        else:
            acc[0].add_(gk)
            acc[1].add_(gv)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held now on the model's device: stored K/V, gradient accumulators and kept
        attention (not what `offload` keeps in host memory: kept_host_bytes)."""
        tensors = [t for pair in (*self._kv.values(), *self._grad.values()) for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors) + self._kept_bytes(host=False)

    def kept_host_bytes(self) -> int:
        """Bytes of attention kept in host memory (--chunkflow-reforward-attention offload)."""
        return self._kept_bytes(host=True)

    def _kept_bytes(self, host: bool) -> int:
        return sum(t.numel() * t.element_size() for layers in self._attention.values()
                   for kept in layers.values() if kept.host == host for t in kept[:2])

    def is_empty(self) -> bool:
        return not self._kv and not self._grad and not self._attention

    def clear(self) -> None:
        """Drop everything (after a forward-only pass, or to recover from an error)."""
        self._kv.clear()
        self._grad.clear()
        self._attention.clear()
        self.version += 1
        self.current = None
        self.keeping = False


class _ChunkKV(torch.autograd.Function):
    """Identity on the chunk's own K/V, concatenated after its sequence's stored prefix."""

    @staticmethod
    def forward(ctx, store, layer, meta, k, v):
        seq, index, dropped = meta.seq_id, meta.index, meta.dropped
        key = (layer, seq, index)
        last = index + 1 == meta.num_siblings
        if not last and not store.reforward:
            # contiguous: V is a view of Megatron's fused QKV output, whose whole buffer (query
            # heads included) a stored view would keep alive
            store._kv[key] = (k.detach().contiguous(), v.detach().contiguous())
        ks, vs = store._prefix(layer, seq, index)
        if last and index in dropped and not store.reforward:
            # SpaCO: chunks from the last back-propagated one on are read only by forwards (done)
            first = max((j for j in range(index) if j not in dropped), default=0)
            for j in range(first, index):
                store._kv.pop((layer, seq, j), None)
        ctx.store, ctx.key = store, key
        ctx.weight, ctx.dropped = meta.grad_weight, dropped
        ctx.lengths = [t.size(0) for t in ks]
        if not ks:
            return k.view_as(k), v.view_as(v)
        k_all, v_all = torch.cat([*ks, k], dim=0), torch.cat([*vs, v], dim=0)
        store.prefix_copies.update((k_all.untyped_storage().data_ptr(),
                                    v_all.untyped_storage().data_ptr()))
        return k_all, v_all

    @staticmethod
    def backward(ctx, gk_all, gv_all):
        store, (layer, seq, index) = ctx.store, ctx.key
        offsets = [0]
        for n in ctx.lengths:
            offsets.append(offsets[-1] + n)
        for j in range(index):
            if j not in ctx.dropped:
                lo, hi = offsets[j], offsets[j + 1]
                store._accumulate((layer, seq, j), gk_all[lo:hi], gv_all[lo:hi])
        p = offsets[-1]
        gk, gv = gk_all[p:], gv_all[p:]
        relayed = store._grad.pop(ctx.key, None)
        if relayed is not None:
            w = ctx.weight
            gk = gk + (relayed[0].to(gk.dtype) if w == 1 else relayed[0].to(gk.dtype) * w)
            gv = gv + (relayed[1].to(gv.dtype) if w == 1 else relayed[1].to(gv.dtype) * w)
        j = index - 1  # the predecessor's K/V were last read by this chunk's final forward,
        while j >= 0:  # and so were those of chunks below a dropped (forward-only) one
            store._kv.pop((layer, seq, j), None)
            if j not in ctx.dropped:
                break
            j -= 1
        return None, None, None, gk, gv
