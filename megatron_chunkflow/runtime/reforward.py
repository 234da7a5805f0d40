"""Re-forwards that skip attention (--chunkflow-reforward-attention keep / offload).

A chunk before the last K of its sequence runs forward twice: F without a graph (only its K/V
state stays), and R with grad right before its backward. R's attention is the costliest part of
it: the chunk's queries against its whole prefix (and under CP the K/V exchange). Its result
cannot differ from F's: the same queries, keys and values (the relay, runtime/state.py, hands R
the same stored prefix; dropout is refused), so F can keep it and R skip it:

- F (`store.keeping`, set by the pipeline for the first forward of a re-forwarded chunk that will
  run backward): each layer's attention runs with the backend's log-sum-exp (attention/lse.py)
  and keeps the output [t, np, hn] and the log-sum-exp in the store (runtime/state.py Kept), on
  the GPU (keep) or copied to pinned host memory (offload, on the compute stream).
- R (and Megatron's recompute inside the chunk's backward, which runs the attention again):
  the layer's Q, K and V are computed as before (the relay needs this chunk's K/V, the backward
  its Q), the attention returns the kept output, and its backward runs from the kept output and
  log-sum-exp, as every pair backend's does (`_FromKept`; under CP runtime/cp.py's ring or
  gather backward, which brings the other ranks' K/V as always). The forward that builds the
  graph takes the kept tensors over from the store (they are then saved activations, counted
  once); a forward without graph (the first pass of Megatron's checkpoint) only reads them.
  After the chunk's backward on the stage the store drops whatever is left.

Exact: the output and log-sum-exp are the very values F computed, and the backward is the pair's
backward from them, as in the recompute path under CP. Memory: per re-forwarded chunk and layer
the output (t x np x hn in the compute dtype, the linear projection's input, which its backward
then saves anyway) and the log-sum-exp (t x np, fp32 under half precision), from F until R: on
the GPU with keep (perfmodel/footprint.py charges it), in host memory with offload.
"""

from __future__ import annotations

import torch

from megatron_chunkflow.attention import (
    attention_backward,
    attention_with_lse,
    lse_pair,
    resolve_backend,
)
from megatron_chunkflow.runtime.state import ChunkMeta, Kept, KVStateStore


def phase(store: KVStateStore, meta: ChunkMeta) -> str | None:
    """"keep" in the first forward of a chunk whose attention is kept, "use" in its re-forward
    and backward, None otherwise."""
    if meta.reforward_attention == "recompute":
        return None
    if store.keeping:
        return "keep"
    return "use" if store.reforward else None


def keep(store: KVStateStore, layer: int, meta: ChunkMeta, out: torch.Tensor,
         lse: torch.Tensor) -> None:
    """Keep `layer`'s attention output and log-sum-exp of the current chunk."""
    host = meta.reforward_attention == "offload"
    if host:
        out, lse = _to_host(out), _to_host(lse)
    store.keep_attention(layer, Kept(out, lse, host))


def check_pair(backend: str, q: torch.Tensor) -> None:
    """keep / offload need the backend's backward from the log-sum-exp (attention/lse.py)."""
    name = resolve_backend(backend, q.device.type, q.dtype)
    if lse_pair(name) is None:
        raise ValueError(f"--chunkflow-reforward-attention keep/offload needs an attention "
                         f"backend with a backward from the log-sum-exp; {name!r} has none for "
                         f"{q.dtype} on {q.device.type} (attention/lse.py)")


def take(store: KVStateStore, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The current chunk's kept (out, lse) of `layer` on `device`; a forward that builds a graph
    takes them over from the store. (Megatron's checkpoints run their first pass without grad,
    which only reads, and take them in the backward's recompute; a checkpoint that kept grad on
    in its first pass would take them too early.)"""
    kept = store.kept_attention(layer, release=torch.is_grad_enabled())
    if not kept.host:
        return kept.out, kept.lse
    return (kept.out.to(device, non_blocking=True), kept.lse.to(device, non_blocking=True))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return host


def attention(store: KVStateStore, layer: int, meta: ChunkMeta, q, k, v, cu_q, cu_kv,
              softmax_scale: float, backend: str) -> torch.Tensor:
    """Without CP: the attention of a chunk whose attention is kept (phase not None), q [t, np,
    hn] over its [prefix ++ own] k, v, bottom-right causal per segment (chunk_attention's)."""
    if phase(store, meta) == "keep":
        check_pair(backend, q)
        out, lse = attention_with_lse(q, k, v, cu_q, cu_kv, softmax_scale=softmax_scale,
                                      backend=backend)
        keep(store, layer, meta, out, lse)
        return out
    out, lse = take(store, layer, q.device)
    return _FromKept.apply(q, k, v, (out, lse), cu_q, cu_kv, softmax_scale, backend)


class _FromKept(torch.autograd.Function):
    """Returns the kept output; the backward is the pair's from the kept output and log-sum-exp
    (the gradients reach q and, through the relay, the [prefix ++ own] K/V)."""

    @staticmethod
    def forward(ctx, q, k, v, kept, cu_q, cu_kv, softmax_scale, backend):
        out, lse = kept
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu_q, cu_kv, softmax_scale, backend)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cu_q, cu_kv, softmax_scale, backend = ctx.args
        dq, dk, dv = attention_backward(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_kv,
                                        softmax_scale=softmax_scale, backend=backend)
        return dq, dk, dv, None, None, None, None, None
