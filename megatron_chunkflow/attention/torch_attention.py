"""The `torch` backend: exact, memory-efficient chunk attention in plain torch (any device, any dtype).

Like flash-attention it saves only q, k, v, the output and the log-sum-exp (float32 for half
precision inputs, which compute in float32) for backward, and
recomputes the probabilities there; the [lq, lk] scores and the mask exist only while one segment is
being computed. F.scaled_dot_product_attention on CPU saves an [lq, lk] mask for backward whenever
lk != lq, which grows with a dependent chunk's prefix (its memory would not follow the chunk size),
so this backend is the CPU default for training. `sdpa` stays the reference it is tested against.

Layers (flash-attention's): _fwd / _bwd on one segment, then TorchChunkAttention (autograd.Function)
over all segments, called by backends.torch_attention_backend.
"""

# Shape suffixes: Q one segment's queries, K its keys, N query heads, G key/value heads,
# R = N // G query heads per group, H head dim; e.g. q_QNH, k_KGH, s_GRQK (scores).

from __future__ import annotations

import torch


def _compute(t: torch.Tensor) -> torch.Tensor:
    """Half precision computes in float32 (scores, log-sum-exp, probabilities), as Megatron's own
    softmax does (attention_softmax_in_fp32); results are cast back where they are stored."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _scores(q_QNH, k_KGH, scale):
    lq, nh, hd = q_QNH.shape
    lk, ng, _ = k_KGH.shape
    q_GRQH = q_QNH.view(lq, ng, nh // ng, hd).permute(1, 2, 0, 3)
    s_GRQK = torch.einsum("grqh,kgh->grqk", q_GRQH, k_KGH) * scale
    if lq > 1:  # bottom-right causal: query i sees keys 0 .. lk - lq + i
        masked_QK = torch.ones(lq, lk, dtype=torch.bool, device=q_QNH.device).triu(lk - lq + 1)
        s_GRQK = s_GRQK.masked_fill(masked_QK, float("-inf"))
    return s_GRQK


def _fwd(q_QNH, k_KGH, v_KGH, scale):
    """One segment: (out_QNH, lse_GRQ)."""
    q_QNH, k_KGH, v_KGH = _compute(q_QNH), _compute(k_KGH), _compute(v_KGH)
    lq, nh, hd = q_QNH.shape
    s_GRQK = _scores(q_QNH, k_KGH, scale)
    lse_GRQ = torch.logsumexp(s_GRQK, dim=-1)
    p_GRQK = torch.exp(s_GRQK - lse_GRQ.unsqueeze(-1))
    o_GRQH = torch.einsum("grqk,kgh->grqh", p_GRQK, v_KGH)
    return o_GRQH.permute(2, 0, 1, 3).reshape(lq, nh, hd), lse_GRQ


def _bwd(dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH, lse_GRQ, scale):
    """One segment: (dq_QNH, dk_KGH, dv_KGH)."""
    dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH = (_compute(t) for t in
                                              (dout_QNH, q_QNH, k_KGH, v_KGH, out_QNH))
    lq, nh, hd = q_QNH.shape
    ng = k_KGH.shape[1]
    to_GRQH = lambda t: t.view(lq, ng, nh // ng, hd).permute(1, 2, 0, 3)  # noqa: E731
    p_GRQK = torch.exp(_scores(q_QNH, k_KGH, scale) - lse_GRQ.unsqueeze(-1))
    do_GRQH, o_GRQH, q_GRQH = to_GRQH(dout_QNH), to_GRQH(out_QNH), to_GRQH(q_QNH)
    dv_KGH = torch.einsum("grqk,grqh->kgh", p_GRQK, do_GRQH)
    dp_GRQK = torch.einsum("grqh,kgh->grqk", do_GRQH, v_KGH)
    delta_GRQ = (do_GRQH * o_GRQH).sum(-1, keepdim=True)
    ds_GRQK = p_GRQK * (dp_GRQK - delta_GRQ) * scale
    dq_GRQH = torch.einsum("grqk,kgh->grqh", ds_GRQK, k_KGH)
    dk_KGH = torch.einsum("grqk,grqh->kgh", ds_GRQK, q_GRQH)
    return dq_GRQH.permute(2, 0, 1, 3).reshape(lq, nh, hd), dk_KGH, dv_KGH


class TorchChunkAttention(torch.autograd.Function):
    """All segments of a chunk; saves q, k, v, out, lse (no probabilities, no masks)."""

    @staticmethod
    def forward(ctx, q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale):
        out_TNH = torch.empty_like(q_TNH)
        lses = []
        for i in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
            if q1 == q0:
                lses.append(None)
                continue
            out_TNH[q0:q1], lse = _fwd(q_TNH[q0:q1], k_TGH[k0:k1], v_TGH[k0:k1], scale)
            lses.append(lse)
        ctx.save_for_backward(q_TNH, k_TGH, v_TGH, out_TNH, *[x for x in lses if x is not None])
        ctx.cu_q, ctx.cu_kv, ctx.scale = cu_q, cu_kv, scale
        return out_TNH

    @staticmethod
    def backward(ctx, dout_TNH):
        q_TNH, k_TGH, v_TGH, out_TNH, *lses = ctx.saved_tensors
        dq_TNH, dk_TGH, dv_TGH = (torch.zeros_like(t) for t in (q_TNH, k_TGH, v_TGH))
        lse_iter = iter(lses)
        cu_q, cu_kv = ctx.cu_q, ctx.cu_kv
        for i in range(len(cu_q) - 1):
            q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
            if q1 == q0:
                continue
            dq, dk, dv = _bwd(dout_TNH[q0:q1], q_TNH[q0:q1], k_TGH[k0:k1], v_TGH[k0:k1],
                              out_TNH[q0:q1], next(lse_iter), ctx.scale)
            dq_TNH[q0:q1], dk_TGH[k0:k1], dv_TGH[k0:k1] = dq, dk, dv
        return dq_TNH, dk_TGH, dv_TGH, None, None, None
