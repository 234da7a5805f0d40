"""Context parallelism (CP) for ChunkFlow: zigzag shards of every chunk, all-gathered K/V, the gather
overlapped with the attention over the keys a rank already holds.

Layout. core/packer pads every segment of a chunk to a multiple of 2 x CP tokens (2 x CP x TP
under sequence parallelism). A segment is cut into 2 x CP equal pieces and CP rank r holds pieces
r and 2 x CP - 1 - r, segment after segment (runtime/cp_keys.py `shard_ranges`). This is
Megatron's THD layout: megatron-core's RoPE picks the same rows from the chunk's positions
(rope_utils, its per-token CASE 1), and every rank's share of a causal segment's attention is
equal. A long sequence's earlier chunks were held the same way, so its K/V state and gradient
accumulators (runtime/state.py) are, per rank, 1/CP of the sequence's.

Attention (`cp_attention`), in every layer: the rank's shards of [earlier chunks' K/V ++ the
chunk's own] are all-gathered over the CP group (one collective for K and V); the keys each local
query piece reads are selected in sequence order and one varlen kernel call runs the pieces as
segments, each attending bottom-right causally to its segment's keys up to its own last token (in
a dependent chunk: the whole prefix too). Every query sees exactly the keys it sees without CP, for
any packing and prefix. The backward reduce-scatters dK/dV back to the ranks holding those K/V,
the sum over ranks taken in fp32 under half precision.

Overlap (--chunkflow-cp-attention overlapped, the default; backends with the log-sum-exp pair).
The gather is issued asynchronously, and while it runs the kernel attends each piece over the keys
this rank holds (its shards of the prefix, its earlier piece, the piece itself last: bottom-right
causal still; cp_keys.split_selection); then, for the pieces that have any, over the other ranks'
keys, all of which precede the piece (one non-causal call); the two results merge by log-sum-exp
(attention/lse.py merge_lse). The backward issues the gather again behind the own keys' backward
(from the merged output and log-sum-exp, as ring attention does: exact), runs the others' keys'
backward, and reduce-scatters one fp32 buffer holding both gradients. Traffic is the gather
path's; on a GPU the collective runs on NCCL's stream beside the kernel. At CP 2 a rank's own keys
are half its pairs on a standalone segment (and 1/CP of a prefix), so a long sequence left whole
hides its gather entirely. `gather` gathers first and runs one call (_LseAttention).

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

import torch
import torch.distributed as dist

from megatron_chunkflow.attention import (
    attention_backward,
    attention_with_lse,
    chunk_attention,
    lse_pair,
    merge_lse,
    resolve_backend,
)
from megatron_chunkflow.runtime.cp_keys import KeySelection, SplitSelection


class Traffic:
    """Bytes one rank receives in ChunkFlow's CP collectives, as NCCL's ring runs them:
    (CP - 1)/CP of an all-gather's output, and of a reduce-scatter's input."""

    def __init__(self):
        self.gathered = 0  # all-gathers of K/V (forwards, and again in backwards)
        self.reduce_scattered = 0  # dK/dV

    @staticmethod
    def received(t: torch.Tensor, size: int) -> int:
        return t.numel() * t.element_size() * (size - 1) // size


def cp_attention(q, k, v, selection: KeySelection | SplitSelection, group, softmax_scale: float,
                 backend: str, traffic: Traffic | None = None) -> torch.Tensor:
    """This rank's attention output [t, np, hn] for its queries q [t, np, hn], given its shards k,
    v [s, ng, hn] of [prefix ++ chunk] K/V (module docstring), or with `group` None the whole
    [prefix ++ chunk] K/V of replicated state (nothing gathered here); `traffic` counts the
    bytes. A SplitSelection overlaps the gather with the attention over the rank's own keys
    (backends with the pair); else the backward runs from the saved log-sum-exp where the
    backend has the pair (attention/lse.py), or recomputes the forward."""
    has_pair = lse_pair(resolve_backend(backend, q.device.type, q.dtype)) is not None
    if isinstance(selection, SplitSelection):
        if not has_pair or group is None:
            raise ValueError(f"the overlapped CP attention needs sharded state and a backend "
                             f"with the log-sum-exp pair; {backend!r} has none here "
                             "(--chunkflow-cp-attention gather)")
        return _OverlappedAttention.apply(q, k, v, selection, group, softmax_scale, backend,
                                          traffic)
    if has_pair:
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


class _OverlappedAttention(torch.autograd.Function):
    """The gather runs while the kernel attends over the rank's own keys (SplitSelection.local);
    then the gathered keys of other ranks (non-causal) for the pieces that have them, merged by
    log-sum-exp. Saves q, k, v, the merged output and log-sum-exp. Backward: the gather again
    behind the own keys' backward, the other keys' backward, one reduce-scatter of dK/dV (the
    own keys' gradient added into this rank's block first)."""

    @staticmethod
    def forward(ctx, q, k, v, split, group, softmax_scale, backend, traffic):
        pending = _GatheredKV(k, v, group, traffic)
        local = split.local
        out, lse = attention_with_lse(q, k.index_select(0, local.index),
                                      v.index_select(0, local.index), local.cu_q, local.cu_kv,
                                      softmax_scale=softmax_scale, backend=backend)
        kv = pending.wait()
        if split.rows.numel():
            out_b, lse_b = attention_with_lse(
                q.index_select(0, split.rows), *_remote_kv(kv, split), split.remote.cu_q,
                split.remote.cu_kv, softmax_scale=softmax_scale, backend=backend, causal=False)
            merge_lse(out, lse, split.rows, out_b, lse_b)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (split, group, softmax_scale, backend, traffic)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        split, group, softmax_scale, backend, traffic = ctx.args
        pending = _GatheredKV(k, v, group, traffic)
        local, rows = split.local, split.rows
        dq, dk_local, dv_local = attention_backward(
            grad_out, q, k.index_select(0, local.index), v.index_select(0, local.index), out,
            lse, local.cu_q, local.cu_kv, softmax_scale=softmax_scale, backend=backend)
        kv = pending.wait()
        size, rank, held = pending.size, pending.rank, k.size(0)
        wide = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        grad = kv.new_zeros(kv.shape, dtype=wide)  # [cp * held, 2, ng, hn]
        mine = local.index + rank * held
        grad[:, 0].index_add_(0, mine, dk_local.to(wide))
        grad[:, 1].index_add_(0, mine, dv_local.to(wide))
        if rows.numel():
            dq_b, dk_b, dv_b = attention_backward(
                grad_out.index_select(0, rows), q.index_select(0, rows), *_remote_kv(kv, split),
                out.index_select(0, rows), lse.index_select(-1, rows), split.remote.cu_q,
                split.remote.cu_kv, softmax_scale=softmax_scale, backend=backend, causal=False)
            dq.index_add_(0, rows, dq_b)
            grad[:, 0].index_add_(0, split.remote.index, dk_b.to(wide))
            grad[:, 1].index_add_(0, split.remote.index, dv_b.to(wide))
        mine = _reduce_scatter(grad, group, size, rank, traffic).to(k.dtype)
        return dq, mine[:, 0], mine[:, 1], None, None, None, None, None


def _remote_kv(kv, split: SplitSelection):
    selected = kv.index_select(0, split.remote.index)  # contiguous, as the kernels take them
    return selected[:, 0], selected[:, 1]


class _GatheredKV:
    """An all-gather of this rank's K and V shards (stacked [s, 2, ng, hn]) under way: wait()
    returns [cp * s, 2, ng, hn], rank after rank."""

    def __init__(self, k, v, group, traffic: Traffic | None):
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.kv = torch.stack([k, v], dim=1)  # held until the collective is done with it
        self.out = self.kv.new_empty((self.size * self.kv.size(0), *self.kv.shape[1:]))
        self.work = _ALL_GATHER(self.out, self.kv, group=group, async_op=True)
        if traffic is not None:
            traffic.gathered += Traffic.received(self.out, self.size)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.kv = None
        return self.out


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
        out = _reduce_scatter(grad.to(wide), group, size, rank, ctx.traffic)
        return out.to(ctx.dtype), None, None


def _reduce_scatter(grad, group, size: int, rank: int, traffic: Traffic | None):
    """This rank's block of the sum over `group` of `grad` [size * s, ...] (all-reduce and slice
    for CPU tensors: gloo has no reduce-scatter)."""
    if grad.device.type == "cpu":
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        out = summed.chunk(size)[rank]
    else:
        grad = grad.contiguous()
        out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad, group=group)
    if traffic is not None:
        traffic.reduce_scattered += out.numel() * out.element_size() * (size - 1)
    return out
