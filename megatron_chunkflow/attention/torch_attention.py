"""The `torch` backend: exact, memory-efficient chunk attention in plain torch (any device, any dtype).

Like flash-attention it saves only q, k, v, the output and the log-sum-exp (float32 for half
precision inputs, which compute in float32) for backward, and recomputes the probabilities there;
scores and masks exist one tile (TILE_QUERIES x TILE_KEYS) at a time, forward and backward, so its
memory follows the chunk and not the prefix. F.scaled_dot_product_attention on CPU saves an
[lq, lk] mask for backward whenever lk != lq, which grows with a dependent chunk's prefix (its
memory would not follow the chunk size). `sdpa` stays the reference this backend is tested
against.

Layers (flash-attention's): _fwd / _bwd on one segment; torch_forward -> (out, lse) and
torch_backward from (dout, q, k, v, out, lse) over all segments; TorchChunkAttention
(autograd.Function) around those two, called by backends.torch_attention_backend. Context
parallelism (runtime/cp.py, through attention/lse.py) calls the two functions itself.
"""

# Shape suffixes: Q one segment's queries, K its keys, N query heads, G key/value heads,
# R = N // G query heads per group, H head dim; e.g. q_QNH, k_KGH, s_GRQK (scores).

from __future__ import annotations

import torch


def _compute(t: torch.Tensor) -> torch.Tensor:
    """Half precision computes in float32 (scores, log-sum-exp, probabilities), as Megatron's own
    softmax does (attention_softmax_in_fp32); results are cast back where they are stored."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# Tiles: a segment is computed in blocks of at most TILE_QUERIES queries x TILE_KEYS keys (flash
# attention's online softmax over key blocks), so the scores that exist at once are
# heads x TILE_QUERIES x TILE_KEYS, whatever the prefix: a 32K chunk over a 256K prefix holds
# O(chunk x head dim) for its output and log-sum-exp plus one tile, never chunk x prefix.
TILE_QUERIES = 1024
TILE_KEYS = 4096


def _scores(q_GRQH, k_KGH, scale, q_pos: int, k_pos: int, lk: int, lq: int, causal: bool):
    """Scores of a tile: queries q_pos.. of the segment, keys k_pos.. (bottom-right causal: query i
    sees keys 0 .. lk - lq + i; not `causal`: all); masked entries are -inf."""
    s_GRQK = torch.einsum("grqh,kgh->grqk", q_GRQH, k_KGH) * scale
    nq, nk = q_GRQH.shape[2], k_KGH.shape[0]
    diagonal = lk - lq + q_pos - k_pos + 1  # the first masked key of the tile's first query
    if causal and diagonal < nk:  # the tile crosses the causal edge
        masked_QK = torch.ones(nq, nk, dtype=torch.bool, device=q_GRQH.device).triu(diagonal)
        s_GRQK = s_GRQK.masked_fill(masked_QK, float("-inf"))
    return s_GRQK


def _key_end(q_end: int, lk: int, lq: int, causal: bool) -> int:
    """One past the last key that the queries before q_end may see."""
    return min(lk, lk - lq + q_end) if causal else lk


def _group(t_QNH: torch.Tensor, ng: int) -> torch.Tensor:
    q, nh, hd = t_QNH.shape
    return t_QNH.view(q, ng, nh // ng, hd).permute(1, 2, 0, 3)


def _ungroup(t_GRQH: torch.Tensor) -> torch.Tensor:
    g, r, q, hd = t_GRQH.shape
    return t_GRQH.permute(2, 0, 1, 3).reshape(q, g * r, hd)


def _fwd(q_QNH, k_KGH, v_KGH, scale, causal):
    """One segment, tile by tile: (out_QNH, lse_GRQ)."""
    q_QNH, k_KGH, v_KGH = _compute(q_QNH), _compute(k_KGH), _compute(v_KGH)
    lq, lk, ng = q_QNH.shape[0], k_KGH.shape[0], k_KGH.shape[1]
    out_QNH = torch.empty_like(q_QNH)
    lses = []
    for q0 in range(0, lq, TILE_QUERIES):
        q1 = min(lq, q0 + TILE_QUERIES)
        q_GRQH = _group(q_QNH[q0:q1], ng)
        acc_GRQH = lse_GRQ = None
        for k0 in range(0, _key_end(q1, lk, lq, causal), TILE_KEYS):
            k1 = min(lk, k0 + TILE_KEYS)
            s_GRQK = _scores(q_GRQH, k_KGH[k0:k1], scale, q0, k0, lk, lq, causal)
            tile_lse = torch.logsumexp(s_GRQK, dim=-1)  # -inf where a query sees no key here
            finite = tile_lse.masked_fill(tile_lse == float("-inf"), 0).unsqueeze(-1)
            tile_GRQH = torch.einsum("grqk,kgh->grqh", torch.exp(s_GRQK - finite), v_KGH[k0:k1])
            if acc_GRQH is None:
                acc_GRQH, lse_GRQ = tile_GRQH, tile_lse
                continue
            # merge two softmax-normalised partial outputs by their log-sum-exp (the first
            # tile holds key 0, which every query sees, so lse_GRQ is finite)
            new_lse = torch.logaddexp(lse_GRQ, tile_lse)
            acc_GRQH = (acc_GRQH * torch.exp(lse_GRQ - new_lse).unsqueeze(-1)
                        + tile_GRQH * torch.exp(tile_lse - new_lse).unsqueeze(-1))
            lse_GRQ = new_lse
        out_QNH[q0:q1] = _ungroup(acc_GRQH)
        lses.append(lse_GRQ)
    return out_QNH, torch.cat(lses, dim=-1)


def _bwd(dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH, lse_GRQ, scale, causal):
    """One segment, tile by tile: (dq_QNH, dk_KGH, dv_KGH)."""
    dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH = (_compute(t) for t in
                                              (dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH))
    lq, lk, ng = q_QNH.shape[0], k_KGH.shape[0], k_KGH.shape[1]
    dq_QNH = torch.empty_like(q_QNH)
    dk_KGH, dv_KGH = torch.zeros_like(k_KGH), torch.zeros_like(v_KGH)
    for q0 in range(0, lq, TILE_QUERIES):
        q1 = min(lq, q0 + TILE_QUERIES)
        q_GRQH, do_GRQH = _group(q_QNH[q0:q1], ng), _group(dout_QNH[q0:q1], ng)
        lse = lse_GRQ[..., q0:q1].unsqueeze(-1)
        delta_GRQ = (do_GRQH * _group(out_QNH[q0:q1], ng)).sum(-1, keepdim=True)
        dq_GRQH = torch.zeros_like(q_GRQH)
        for k0 in range(0, _key_end(q1, lk, lq, causal), TILE_KEYS):
            k1 = min(lk, k0 + TILE_KEYS)
            p_GRQK = torch.exp(_scores(q_GRQH, k_KGH[k0:k1], scale, q0, k0, lk, lq, causal) - lse)
            dv_KGH[k0:k1] += torch.einsum("grqk,grqh->kgh", p_GRQK, do_GRQH)
            dp_GRQK = torch.einsum("grqh,kgh->grqk", do_GRQH, v_KGH[k0:k1])
            ds_GRQK = p_GRQK * (dp_GRQK - delta_GRQ) * scale
            dq_GRQH += torch.einsum("grqk,kgh->grqh", ds_GRQK, k_KGH[k0:k1])
            dk_KGH[k0:k1] += torch.einsum("grqk,grqh->kgh", ds_GRQK, q_GRQH)
        dq_QNH[q0:q1] = _ungroup(dq_GRQH)
    return dq_QNH, dk_KGH, dv_KGH


def torch_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal=True):
    """All segments of a chunk: (out_TNH, lse_GRT), the log-sum-exp of every query and head
    (grouped by K/V head, in the compute dtype), for torch_backward. `causal` False: every query
    sees all of its segment's keys."""
    tq, nh, ng = q_TNH.shape[0], q_TNH.shape[1], k_TGH.shape[1]
    out_TNH = torch.empty_like(q_TNH)
    wide = torch.float32 if q_TNH.dtype in (torch.float16, torch.bfloat16) else q_TNH.dtype
    lse_GRT = torch.empty((ng, nh // ng, tq), dtype=wide, device=q_TNH.device)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
        if q1 > q0:
            out_TNH[q0:q1], lse_GRT[..., q0:q1] = _fwd(q_TNH[q0:q1], k_TGH[k0:k1], v_TGH[k0:k1],
                                                       scale, causal)
    return out_TNH, lse_GRT


def torch_backward(dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse_GRT, cu_q, cu_kv, scale,
                   causal=True):
    """(dq_TNH, dk_TGH, dv_TGH) from torch_forward's output and log-sum-exp, no forward."""
    dq_TNH, dk_TGH, dv_TGH = (torch.zeros_like(t) for t in (q_TNH, k_TGH, v_TGH))
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
        if q1 == q0:
            continue
        dq, dk, dv = _bwd(dout_TNH[q0:q1], q_TNH[q0:q1], k_TGH[k0:k1], v_TGH[k0:k1],
                          out_TNH[q0:q1], lse_GRT[..., q0:q1], scale, causal)
        dq_TNH[q0:q1], dk_TGH[k0:k1], dv_TGH[k0:k1] = dq, dk, dv
    return dq_TNH, dk_TGH, dv_TGH


class TorchChunkAttention(torch.autograd.Function):
    """All segments of a chunk; saves q, k, v, out, lse (no probabilities, no masks)."""

    @staticmethod
    def forward(ctx, q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale):
        out_TNH, lse_GRT = torch_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale)
        ctx.save_for_backward(q_TNH, k_TGH, v_TGH, out_TNH, lse_GRT)
        ctx.cu_q, ctx.cu_kv, ctx.scale = cu_q, cu_kv, scale
        return out_TNH

    @staticmethod
    def backward(ctx, dout_TNH):
        grads = torch_backward(dout_TNH, *ctx.saved_tensors, ctx.cu_q, ctx.cu_kv, ctx.scale)
        return *grads, None, None, None
