"""Context parallelism (CP) for ChunkFlow: zigzag shards of every chunk; attention over the other
ranks' K/V passed around a ring behind the kernel, or all-gathered first (the exchanges
themselves: runtime/cp_comm.py).

Layout. core/packer pads every segment of a chunk to a multiple of 2 x CP tokens, and the chunk
(its last segment) to 2 x CP x TP under sequence parallelism. A segment is cut into 2 x CP equal
pieces and CP rank r holds pieces r and 2 x CP - 1 - r, segment after segment
(runtime/cp_keys.py `shard_ranges`). This is Megatron's THD layout: megatron-core's RoPE picks the
same rows from the chunk's positions (rope_utils, its per-token CASE 1), and every rank's share
of a causal segment's attention is equal. A long sequence's earlier chunks were held the same
way, so its K/V state and gradient accumulators (runtime/state.py) are, per rank, 1/CP of the
sequence's.

Attention (`cp_attention`), in every layer. Every query must see exactly the keys it sees without
CP, for any packing and prefix: its segment's keys up to its own (in a dependent chunk, the whole
prefix too). Two ways:

- ring (--chunkflow-cp-attention ring, the default; backends with the log-sum-exp pair). Each
  rank's block, its shards of [earlier chunks' K/V ++ the chunk's own] (K and V stacked), goes
  around the CP ranks in CP - 1 steps (batch_isend_irecv to the next rank, from the previous);
  step s attends the local pieces over the block of rank (r - s) mod CP while the next block
  travels: the own block bottom-right causally (each piece's own keys last), every other block
  without a mask (cp_keys.ring_selection: the keys a piece reads from it all precede it), for
  the pieces that read any of it. The partial results merge by log-sum-exp (attention/lse.py
  merge_lse), exactly. The backward runs the ring again, each step's kernel backward from the
  merged output and log-sum-exp (exact, as in ring attention); a block's gradient (fp32 under
  half precision) starts at the rank after its owner, gathers each rank's share as the ring
  turns and reaches its owner after the last step, which adds its own.
- gather (--chunkflow-cp-attention gather, and backends without the pair): the blocks are
  all-gathered (one collective), the keys each piece reads selected in sequence order
  (key_selection) and one varlen kernel call runs the pieces as segments; the backward
  reduce-scatters dK/dV, the sum over ranks in fp32 under half precision.

Both move the same bytes: per rank, layer and chunk (CP - 1)/CP x (prefix + chunk) tokens of K
and V forward, that again backward and the gradient's. The ring hides them behind the kernels
(but the last gradient block) and holds two blocks at a time instead of the gathered whole.

Memory. Neither the other ranks' K/V nor the selections are saved: the local q and [prefix ++ own]
K/V shards are saved, with the kernel's output and log-sum-exp where the backend has a
forward/backward pair (attention/lse.py: cpu_flash, torch, flash, varlen); the backward brings
the K/V again (ring or gather) and runs the kernel's backward from the saved output and
log-sum-exp, with no attention forward (`_RingAttention`, `_LseAttention`). The output is the
projection's input, which Megatron saves anyway (one storage), so the extra is the log-sum-exp,
one float32 per head and local token under half precision. Backends without the pair (sdpa, flex, te) save
only q, k, v and recompute the local attention forward in the backward before its backward
(`_RecomputedAttention`). The gather path holds transiently the gathered K/V and the selection
(about 2 x prefix + 1.25 x chunk tokens of K and V at CP = 2), the ring two blocks and a step's
selection. Activations and state per rank are ~1/CP of CP = 1's; the price is the K/V sent again
in the backward (and, without the pair, one more attention forward per layer).

Replicated state (`--chunkflow-cp-kv replicated`, ChunkMeta.cp_kv). A dependent chunk's own K/V
shards are all-gathered first (`gather_chunk_kv`, in every layer), and the relay then works on whole
chunks: every CP rank holds the sequence's whole K/V buffer, CP times the sharded state, and reads
[prefix ++ chunk] from it; the attention selects from it without a collective (key_selection(...,
replicated=True): rows chunk after chunk, each rank after rank). In the backward the attention runs
on the saved [prefix ++ chunk] (no gather), the relay accumulates each earlier chunk's gradient from
this rank's queries in the whole-chunk rows of its accumulator, and the gather's backward
reduce-scatters the chunk's own K/V gradient (this rank's queries' share plus what its accumulator
relayed), so the sum over ranks arrives on the rank holding each shard. Per rank, layer and chunk it
receives (CP - 1)/CP x chunk tokens of K and V per forward and the same of dK/dV: the prefix is
never sent again. What is saved for the backward is the [prefix ++ chunk] K/V, as without CP (the
sharded path saves 1/CP of it). Standalone chunks run as above in both.

Shapes: THD per TP rank, q [t, np, hn], k/v [t, ng, hn], t = this CP rank's tokens.
"""

from __future__ import annotations

import torch

from megatron_chunkflow.attention import (
    attention_backward,
    attention_with_lse,
    chunk_attention,
    lse_pair,
    merge_lse,
    resolve_backend,
)
from megatron_chunkflow.runtime.cp_comm import Peers, Traffic, gather_chunk_kv
from megatron_chunkflow.runtime.cp_keys import KeySelection, RingSelection


def cp_attention(q, k, v, selection: KeySelection | RingSelection, group, softmax_scale: float,
                 backend: str, traffic: Traffic | None = None, *, kept=None,
                 sink: list | None = None) -> torch.Tensor:
    """This rank's attention output [t, np, hn] for its queries q [t, np, hn], given its shards k,
    v [s, ng, hn] of [prefix ++ chunk] K/V (module docstring), or with `group` None the whole
    [prefix ++ chunk] K/V of replicated state (nothing gathered here); `traffic` counts the
    bytes. A RingSelection runs the ring (backends with the pair); else the backward runs from
    the saved log-sum-exp where the backend has the pair (attention/lse.py), or recomputes the
    forward. A re-forward that skips attention (runtime/reforward.py) passes `kept`, the (out,
    lse) of the chunk's first forward: nothing is computed or moved forward, the backward is as
    always; that first forward passes `sink`, a list the (out, lse) it computes is appended to."""
    has_pair = lse_pair(resolve_backend(backend, q.device.type, q.dtype)) is not None
    if isinstance(selection, RingSelection):
        if not has_pair or group is None:
            raise ValueError(f"the ring CP attention needs sharded state and a backend with the "
                             f"log-sum-exp pair; {backend!r} has none here "
                             "(--chunkflow-cp-attention gather)")
        return _RingAttention.apply(q, k, v, selection, group, softmax_scale, backend, traffic,
                                    kept, sink)
    if has_pair:
        return _LseAttention.apply(q, k, v, selection, group, softmax_scale, backend, traffic,
                                   kept, sink)
    if kept is not None or sink is not None:
        raise ValueError(f"--chunkflow-reforward-attention keep/offload needs a backend with the "
                         f"log-sum-exp pair; {backend!r} has none here")
    return _RecomputedAttention.apply(q, k, v, selection, group, softmax_scale, backend, traffic)


class _LseAttention(torch.autograd.Function):
    """Saves the local q, k, v, the output and the log-sum-exp; the backward gathers and selects
    K/V again (under autograd) and runs the backend's backward from them, no forward."""

    @staticmethod
    def forward(ctx, q, k, v, selection, group, softmax_scale, backend, traffic, kept, sink):
        if kept is not None:
            out, lse = kept
        else:
            k_sel, v_sel = _select(k, v, selection, group, traffic)
            out, lse = attention_with_lse(q, k_sel, v_sel, selection.cu_q, selection.cu_kv,
                                          softmax_scale=softmax_scale, backend=backend)
        if sink is not None:
            sink.append((out, lse))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (selection, group, softmax_scale, backend, traffic)
        return out.view_as(out)

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
        return dq, k.grad, v.grad, None, None, None, None, None, None, None


class _RingAttention(torch.autograd.Function):
    """The ring (module docstring): step s attends over the block of rank (rank - s) mod CP while
    the next block travels; partial results merge by log-sum-exp. Saves q, k, v, the merged
    output and log-sum-exp. The backward runs the ring again, each step's backward from the
    merged output and log-sum-exp; a block's fp32 gradient travels with the ring, each rank
    adding its share, and arrives at the block's owner after the last step."""

    @staticmethod
    def forward(ctx, q, k, v, ring, group, softmax_scale, backend, traffic, kept, sink):
        out, lse = kept if kept is not None else _ring_forward(q, k, v, ring, group,
                                                               softmax_scale, backend, traffic)
        if sink is not None:
            sink.append((out, lse))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, group, softmax_scale, backend, traffic)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, group, softmax_scale, backend, traffic = ctx.args
        peers = Peers(group)
        wide = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        kv = torch.stack([k, v], dim=1)
        dq = torch.zeros_like(q, dtype=wide)
        own = incoming = None
        for step, block in enumerate(ring.blocks):
            arriving = peers.exchange(kv, traffic, "gathered") if step + 1 < peers.size else None
            grad = kv.new_zeros(kv.shape, dtype=wide)  # this block's gradient from our queries
            if block.rows.numel():
                rows = _subset(block, q, step)
                k_b, v_b = _block_kv(kv, block, k, v, step)
                dq_b, dk_b, dv_b = attention_backward(
                    _rows(grad_out, rows), _rows(q, rows), k_b, v_b, _rows(out, rows),
                    lse if rows is None else lse.index_select(-1, rows), block.keys.cu_q,
                    block.keys.cu_kv, softmax_scale=softmax_scale, backend=backend,
                    causal=step == 0)
                if rows is None:
                    dq += dq_b
                else:
                    dq.index_add_(0, rows, dq_b.to(wide))
                grad[:, 0].index_add_(0, block.keys.index, dk_b.to(wide))
                grad[:, 1].index_add_(0, block.keys.index, dv_b.to(wide))
            if step == 0:
                own = grad  # kept: the other ranks' shares come back after the last step
            else:
                if incoming is not None:
                    grad += incoming.wait()  # the ranks before us on the ring
                incoming = peers.exchange(grad, traffic, "reduce_scattered")
            if arriving is not None:
                kv = arriving.wait()
        own += incoming.wait()
        return (dq.to(q.dtype), own[:, 0].to(k.dtype), own[:, 1].to(v.dtype), None, None, None,
                None, None, None, None)


def _ring_forward(q, k, v, ring, group, softmax_scale, backend, traffic):
    """The ring's forward (module docstring): (out, lse) of this rank's queries."""
    peers = Peers(group)
    kv, out, lse = torch.stack([k, v], dim=1), None, None
    for step, block in enumerate(ring.blocks):
        arriving = peers.exchange(kv, traffic, "gathered") if step + 1 < peers.size else None
        if block.rows.numel():
            rows = _subset(block, q, step)
            k_b, v_b = _block_kv(kv, block, k, v, step)
            part = attention_with_lse(_rows(q, rows), k_b, v_b, block.keys.cu_q,
                                      block.keys.cu_kv, softmax_scale=softmax_scale,
                                      backend=backend, causal=step == 0)
            if step == 0:
                out, lse = part
            else:
                merge_lse(out, lse, rows, *part)
        if arriving is not None:
            kv = arriving.wait()
    return out, lse


def _subset(block, q, step):
    """The query rows a step reads for, None when it is all of them (the own block, and any
    block every piece reads: a dependent chunk's, whose prefix precedes every piece)."""
    return None if step == 0 or block.rows.numel() == q.shape[0] else block.rows


def _rows(x, rows):
    return x if rows is None else x.index_select(0, rows)


def _block_kv(kv, block, k, v, step):
    """The keys and values a step reads (contiguous, as the kernels take them)."""
    if step == 0:
        return k.index_select(0, block.keys.index), v.index_select(0, block.keys.index)
    selected = kv.index_select(0, block.keys.index)
    return selected[:, 0], selected[:, 1]


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


def _attend(q, k, v, selection, group, softmax_scale, backend, traffic=None):
    k, v = _select(k, v, selection, group, traffic)
    return chunk_attention(q, k, v, selection.cu_q, selection.cu_kv, softmax_scale=softmax_scale,
                           backend=backend)
