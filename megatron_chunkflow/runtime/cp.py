"""Context parallelism (CP) for ChunkFlow: zigzag shards of every chunk, all-gather attention.

Layout. core/packer pads every segment of a chunk to a multiple of 2 x CP tokens (2 x CP x TP
under sequence parallelism). A segment is cut into 2 x CP equal pieces and CP rank r holds pieces
r and 2 x CP - 1 - r, segment after segment (`shard_ranges`). This is Megatron's THD layout:
megatron-core's RoPE picks the same rows from the chunk's positions (rope_utils, its per-token
CASE 1), and every rank's share of a causal segment's attention is equal. A long sequence's
earlier chunks were held the same way, so its K/V state and gradient accumulators
(runtime/state.py) are, per rank, 1/CP of the sequence's.

Attention (`cp_attention`), in every layer: the rank's shards of [earlier chunks' K/V ++ the
chunk's own] are all-gathered over the CP group (one collective for K and V); one index puts the
keys each local query piece reads in sequence order, and one varlen kernel call runs the pieces as
segments, each attending bottom-right causally to its segment's keys up to its own last token (in
a dependent chunk: the whole prefix too). Every query sees exactly the keys it sees without CP, for
any packing and prefix. The backward reduce-scatters dK/dV back to the ranks holding those K/V,
the sum over ranks taken in fp32 under half precision (a key two local pieces both read gets their
two gradients added in the K/V dtype first); the relay takes it from there.

Memory and traffic. The gather and the index are redone in the backward, not saved: the local q
and [prefix ++ own] K/V shards are saved, with the kernel's output and log-sum-exp where the
backend has a forward/backward pair (attention/lse.py: cpu_flash, torch, flash, varlen); the
backward gathers again, selects under autograd and runs the kernel's backward from the saved
output and log-sum-exp, with no attention forward (`_LseAttention`). The output is the projection's
input, which Megatron saves anyway (one storage), so the extra is the log-sum-exp, one float32 per
head and local token under half precision. Backends without the pair (sdpa, flex, te) save only q, k, v
and recompute the local attention forward in the backward before its backward
(`_RecomputedAttention`). Per rank, layer and chunk it receives (CP - 1)/CP x (prefix + chunk)
tokens of K and V forward and twice that backward (the gather again, the reduce-scatter), and holds
transiently the gathered K/V and the selection (about 2 x prefix + 1.25 x chunk tokens of K and V
at CP = 2). Activations and state per rank are ~1/CP of CP = 1's; the price is the second gather
(and, without the pair, one more attention forward per layer).

Replicated state (`--chunkflow-cp-kv replicated`, ChunkMeta.cp_kv). A dependent chunk's own K/V
shards are all-gathered first (`gather_chunk_kv`, in every layer), and the relay then works on
whole chunks: every CP rank stores every earlier chunk's whole K/V, CP times the sharded state, and
concatenates [prefix ++ chunk] locally; the attention selects from it without a collective
(key_selection(..., replicated=True): rows chunk after chunk, each rank after rank). In the
backward the attention runs on the saved [prefix ++ chunk] (no gather), the relay accumulates each
earlier chunk's gradient from this rank's queries in a whole-chunk accumulator, and the gather's
backward reduce-scatters the chunk's own K/V gradient (this rank's queries' share plus what its
accumulator relayed), so the sum over ranks arrives on the rank holding each shard. Per rank,
layer and chunk it receives (CP - 1)/CP x chunk tokens of K and V per forward and the same of
dK/dV: the prefix is never sent again. What is saved for the backward is the [prefix ++ chunk]
K/V, as without CP (the sharded path saves 1/CP of it). Standalone chunks run as above in both.

Shapes: THD per TP rank, q [t, np, hn], k/v [t, ng, hn], t = this CP rank's tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron_chunkflow.attention import (
    attention_backward,
    attention_with_lse,
    chunk_attention,
    lse_pair,
    resolve_backend,
)


def shard_ranges(cu_seqlens, cp: int, rank: int) -> list[tuple[int, int]]:
    """The [lo, hi) token ranges of a chunk with segment boundaries `cu_seqlens` that CP rank
    `rank` holds, in its local order: pieces rank and 2 cp - 1 - rank of each segment."""
    out = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if (b - a) % (2 * cp):
            raise ValueError(f"segment [{a}, {b}) has {b - a} tokens, which do not cut into "
                             f"2 x CP = {2 * cp} equal pieces (core/packer pads segments)")
        piece = (b - a) // (2 * cp)
        out += [(a + i * piece, a + (i + 1) * piece) for i in (rank, 2 * cp - 1 - rank)]
    return out


def local_index(cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """Indices (into the whole chunk) of the tokens CP rank `rank` holds, in its local order."""
    ranges = shard_ranges(cu_seqlens, cp, rank)
    return torch.cat([torch.arange(lo, hi) for lo, hi in ranges] or [torch.zeros(0, dtype=torch.long)])


class KeySelection(NamedTuple):
    """Which rows of a chunk's gathered K/V (prefix included) one CP rank's query pieces read."""

    index: torch.Tensor  # rows of the gathered K/V the pieces read, piece after piece
    cu_q: tuple[int, ...]  # the local queries cut into pieces (the kernel's segments)
    cu_kv: tuple[int, ...]  # each piece's keys within `index`


@lru_cache(maxsize=8)  # host memory: a late chunk's index lists its whole prefix twice
def key_selection(cu_seqlens: tuple[int, ...], prefix_chunks: int, chunk_size: int, cp: int,
                  rank: int, replicated: bool = False) -> KeySelection:
    """The key selection for a chunk with segment boundaries `cu_seqlens` after `prefix_chunks`
    earlier chunks of `chunk_size` tokens (a dependent chunk: one segment), on CP rank `rank`, on
    the host (runtime/model.py keeps the device copy for one forward).

    Rows of the K/V it indexes: sharded state (the default), rank after rank, each rank's shards of
    the prefix chunks and then of this chunk (what runtime/state.py's relay concatenates, then
    gathered); `replicated` state, chunk after chunk, each chunk's shards rank after rank (each
    chunk's K/V gathered once, then concatenated by the relay)."""
    prefix = prefix_chunks * chunk_size
    if prefix and len(cu_seqlens) != 2:
        raise ValueError("a dependent chunk has one segment")
    blocks = [((0, chunk_size), i * chunk_size) for i in range(prefix_chunks)]
    blocks.append((cu_seqlens, prefix))
    order = ([(r, b) for b in blocks for r in range(cp)] if replicated
             else [(r, b) for r in range(cp) for b in blocks])
    natural = torch.cat([torch.arange(offset + lo, offset + hi)  # each row's position
                         for r, (cu, offset) in order for lo, hi in shard_ranges(cu, cp, r)])
    row = torch.empty_like(natural)
    row[natural] = torch.arange(natural.numel())
    rows, cu_q, cu_kv = [], [0], [0]
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        first = 0 if prefix else a  # the segment's first key
        for lo, hi in shard_ranges((a, b), cp, rank):
            rows.append(row[first:prefix + hi])  # a piece sees its segment's keys up to its end
            cu_q.append(cu_q[-1] + hi - lo)
            cu_kv.append(cu_kv[-1] + prefix + hi - first)
    return KeySelection(torch.cat(rows), tuple(cu_q), tuple(cu_kv))


class Traffic:
    """Bytes one rank receives in ChunkFlow's CP collectives, as NCCL's ring runs them:
    (CP - 1)/CP of an all-gather's output, and of a reduce-scatter's input."""

    def __init__(self):
        self.gathered = 0  # all-gathers of K/V (forwards, and again in backwards)
        self.reduce_scattered = 0  # dK/dV

    @staticmethod
    def received(t: torch.Tensor, size: int) -> int:
        return t.numel() * t.element_size() * (size - 1) // size


def cp_attention(q, k, v, selection: KeySelection, group, softmax_scale: float, backend: str,
                 traffic: Traffic | None = None) -> torch.Tensor:
    """This rank's attention output [t, np, hn] for its queries q [t, np, hn], given its shards k,
    v [s, ng, hn] of [prefix ++ chunk] K/V (module docstring), or with `group` None the whole
    [prefix ++ chunk] K/V of replicated state (nothing gathered here); `traffic` counts the
    bytes. The backward runs from the saved log-sum-exp where the backend has the pair
    (attention/lse.py), else recomputes the forward."""
    if lse_pair(resolve_backend(backend, q.device.type, q.dtype)) is not None:
        return _LseAttention.apply(q, k, v, selection, group, softmax_scale, backend, traffic)
    return _RecomputedAttention.apply(q, k, v, selection, group, softmax_scale, backend, traffic)


class _LseAttention(torch.autograd.Function):
    """Saves the local q, k, v, the output and the log-sum-exp; the backward gathers and selects
    K/V again (under autograd) and runs the backend's backward from them, no forward."""

    @staticmethod
    def forward(ctx, q, k, v, selection, group, softmax_scale, backend, traffic):
        k_sel, v_sel = _select(k, v, selection, group, traffic)
        out, lse = attention_with_lse(q, k_sel, v_sel, selection.cu_q, selection.cu_kv,
                                      softmax_scale=softmax_scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (selection, group, softmax_scale, backend, traffic)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        selection, group, softmax_scale, backend, traffic = ctx.args
        k, v = (x.detach().requires_grad_() for x in (k, v))
        with torch.enable_grad():
            k_sel, v_sel = _select(k, v, selection, group, traffic)
        dq, dk_sel, dv_sel = attention_backward(
            grad_out, q, k_sel.detach(), v_sel.detach(), out, lse, selection.cu_q,
            selection.cu_kv, softmax_scale=softmax_scale, backend=backend)
        torch.autograd.backward((k_sel, v_sel), (dk_sel, dv_sel))
        return dq, k.grad, v.grad, None, None, None, None, None


class _RecomputedAttention(torch.autograd.Function):
    """Saves only the local q, k, v; the backward gathers and recomputes, then back-propagates
    (backends without the pair: sdpa, flex, te).

    A Function rather than torch.utils.checkpoint: its saves and its backward's recompute go
    through the saved-tensor hooks of whoever meters memory (runtime/meter.py), as Megatron's own
    recompute does."""

    @staticmethod
    def forward(ctx, q, k, v, selection, group, softmax_scale, backend, traffic):
        ctx.save_for_backward(q, k, v)
        ctx.args = (selection, group, softmax_scale, backend, traffic)
        return _attend(q, k, v, *ctx.args)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = _attend(q, k, v, *ctx.args)
        torch.autograd.backward(out, grad_out)
        return q.grad, k.grad, v.grad, None, None, None, None, None


def _select(k, v, selection, group, traffic=None):
    """The keys and values this rank's query pieces read, from the gathered K/V (`group` None:
    from k and v as they are, already whole: replicated state)."""
    if group is not None:
        k, v = gather_chunk_kv(k, v, group, traffic)
    # index_select copies: the kernels take contiguous K and V
    return k.index_select(0, selection.index), v.index_select(0, selection.index)


def gather_chunk_kv(k, v, group, traffic: Traffic | None = None):
    """The whole K and V [cp * s, ng, hn] from every rank's shard (rank after rank), in one
    collective (the attention's gather, and a chunk's own K/V under replicated state); the
    backward reduce-scatters their gradient (fp32 under half precision)."""
    kv = _GatherKV.apply(torch.stack([k, v], dim=1), group, traffic)  # [cp * s, 2, ng, hn]
    return kv[:, 0], kv[:, 1]


def _attend(q, k, v, selection, group, softmax_scale, backend, traffic=None):
    k, v = _select(k, v, selection, group, traffic)
    return chunk_attention(q, k, v, selection.cu_q, selection.cu_kv, softmax_scale=softmax_scale,
                           backend=backend)


# torch >= 2.12 names them *_single (the *_tensor names are deprecated)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: reduce-scatter (summed in fp32 under half
    precision; all-reduce and slice for CPU tensors: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, traffic):
        ctx.group, ctx.dtype, ctx.traffic = group, x.dtype, traffic
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        if traffic is not None:
            traffic.gathered += Traffic.received(out, size)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        if grad.device.type == "cpu":  # gloo, which has no reduce-scatter
            summed = grad.to(wide, memory_format=torch.contiguous_format, copy=True)
            dist.all_reduce(summed, group=group)
            out = summed.chunk(size)[rank]
        else:
            grad = grad.to(wide).contiguous()
            out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
            _REDUCE_SCATTER(out, grad, group=group)
        if ctx.traffic is not None:
            ctx.traffic.reduce_scattered += out.numel() * out.element_size() * (size - 1)
        return out.to(ctx.dtype), None, None
