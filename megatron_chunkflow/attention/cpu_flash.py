"""The `cpu_flash` backend: torch's own fused CPU flash-attention kernel, for chunks with a prefix.

    out = chunk_attention(q, k, v, cu_q, cu_kv, backend="cpu_flash")   # CPU tensors, fp32/fp64

ATen ships a blocked, online-softmax attention kernel for CPU
(`aten::_scaled_dot_product_flash_attention_for_cpu` and its `_backward`; the one
F.scaled_dot_product_attention picks on CPU when there is no mask). It saves only q, k, v, the
output and the log-sum-exp, and it is 20-40x faster than the plain-torch `torch` backend. Its
causal mask is top-left aligned, so a segment whose queries follow a prefix (lk > lq) is computed
in two calls and merged:

    prefix keys [0, lk - lq)   every query sees all of them        causal=False
    own keys    [lk - lq, lk)  lq x lq, top-left == bottom-right    causal=True

and the partial results are combined by log-sum-exp (`merge_partial`, the sigmoid form of
ring-flash-attention's `update_out_and_lse`, derived in
https://github.com/zhuzilin/ring-flash-attention/pull/34). The backward calls the kernel's
backward once per part with the *merged* output and log-sum-exp: the probabilities it rebuilds,
exp(s - lse), are then those of the full softmax, and delta = rowsum(dout * out) is the full
row's, so the parts' dq add up and each part's dk, dv are exact (as in ring attention).
No mask and nothing [lq, lk]-sized is ever saved, so memory stays linear in the prefix.

The two halves are plain functions, `cpu_flash_forward` -> (out, lse) and `cpu_flash_backward`
from (dout, q, k, v, out, lse); CpuFlashChunkAttention is autograd around them, and context
parallelism (runtime/cp.py, through attention/lse.py) calls them itself.
"""

# Shape suffixes: T packed tokens, N query heads, G key/value heads, H head dim; B = 1 batch,
# Q / K one segment's queries / keys; e.g. q_BNQH, lse_BNQ.

from __future__ import annotations

import torch
import torch.nn.functional as F

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _bnqh(x_TNH: torch.Tensor) -> torch.Tensor:
    return x_TNH.transpose(0, 1).unsqueeze(0)


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Attention over keys A and keys B from the two partial results (out [B, N, Q, H], lse
    [B, N, Q]): out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), in the stable form."""
    out = out_a - torch.sigmoid(lse_b - lse_a).unsqueeze(-1) * (out_a - out_b)
    lse = lse_a - F.logsigmoid(lse_a - lse_b)
    return out, lse


def _expand_kv(k_BGKH, num_heads: int):
    """GQA: query head h reads K/V head h // (N // G); the kernel wants N heads on both sides."""
    groups = k_BGKH.shape[1]
    return k_BGKH if groups == num_heads else k_BGKH.repeat_interleave(num_heads // groups, dim=1)


def _fold_kv_grad(dk_BNKH, groups: int):
    b, n, lk, h = dk_BNKH.shape
    return dk_BNKH if groups == n else dk_BNKH.view(b, groups, n // groups, lk, h).sum(2)


def _own_split(cu_q, cu_kv, i: int) -> tuple[int, int, int, int, int]:
    """Segment i's query range, key range and the first of its own keys (after the prefix)."""
    q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
    return q0, q1, k0, k1, k1 - (q1 - q0)


def _parts(cu_q, cu_kv, i: int, causal: bool) -> list[tuple[int, int, bool]]:
    """Segment i's key ranges and the kernel's causal flag for each: its own keys (causal) and
    its prefix (not); with `causal` False, all its keys in one non-causal part."""
    q0, q1, k0, k1, split = _own_split(cu_q, cu_kv, i)
    if not causal:
        return [(k0, k1, False)]
    return [(split, k1, True)] + ([(k0, split, False)] if split > k0 else [])


def cpu_flash_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale, causal=True):
    """All segments of a chunk: (out_TNH, lse_NT), the merged log-sum-exp of every query and head
    (in the kernel's dtype: float32 for bfloat16 inputs), for cpu_flash_backward. `causal` False:
    every query sees all of its segment's keys."""
    nh, tq = q_TNH.shape[1], q_TNH.shape[0]
    out_TNH = torch.empty_like(q_TNH)
    lse_NT = None
    for i in range(len(cu_q) - 1):
        q0, q1 = cu_q[i], cu_q[i + 1]
        if q1 == q0:
            continue
        q_BNQH = _bnqh(q_TNH[q0:q1])
        out_BNQH = lse_BNQ = None
        for a, b, part_causal in _parts(cu_q, cu_kv, i, causal):
            k_part, v_part = (_expand_kv(_bnqh(x[a:b]), nh) for x in (k_TGH, v_TGH))
            out_p, lse_p = _fwd(q_BNQH, k_part, v_part, 0.0, part_causal, scale=scale)
            out_BNQH, lse_BNQ = ((out_p, lse_p) if out_BNQH is None
                                 else merge_partial(out_BNQH, lse_BNQ, out_p, lse_p))
        out_TNH[q0:q1] = out_BNQH[0].transpose(0, 1)
        if lse_NT is None:
            lse_NT = lse_BNQ.new_empty((nh, tq))
        lse_NT[:, q0:q1] = lse_BNQ[0]
    return out_TNH, lse_NT


def cpu_flash_backward(dout_TNH, q_TNH, k_TGH, v_TGH, out_TNH, lse_NT, cu_q, cu_kv, scale,
                       causal=True):
    """(dq_TNH, dk_TGH, dv_TGH) from cpu_flash_forward's output and log-sum-exp: the kernel's
    backward once per part of each segment (module docstring), no forward."""
    nh, ng = q_TNH.shape[1], k_TGH.shape[1]
    dq_TNH, dk_TGH, dv_TGH = (torch.zeros_like(t) for t in (q_TNH, k_TGH, v_TGH))
    for i in range(len(cu_q) - 1):
        q0, q1 = cu_q[i], cu_q[i + 1]
        if q1 == q0:
            continue
        lse_BNQ = lse_NT[:, q0:q1].unsqueeze(0).contiguous()
        q_BNQH, o_BNQH = _bnqh(q_TNH[q0:q1]), _bnqh(out_TNH[q0:q1])
        do_BNQH = _bnqh(dout_TNH[q0:q1].contiguous())
        for a, b, part_causal in _parts(cu_q, cu_kv, i, causal):
            k_part, v_part = (_expand_kv(_bnqh(x[a:b]), nh) for x in (k_TGH, v_TGH))
            dq, dk, dv = _bwd(do_BNQH, q_BNQH, k_part, v_part, o_BNQH, lse_BNQ, 0.0, part_causal,
                              scale=scale)
            dq_TNH[q0:q1] += dq[0].transpose(0, 1)
            dk_TGH[a:b] = _fold_kv_grad(dk, ng)[0].transpose(0, 1)
            dv_TGH[a:b] = _fold_kv_grad(dv, ng)[0].transpose(0, 1)
    return dq_TNH, dk_TGH, dv_TGH


class CpuFlashChunkAttention(torch.autograd.Function):
    """All segments of a chunk through ATen's CPU flash kernel; saves q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale):
        out_TNH, lse_NT = cpu_flash_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, scale)
        ctx.save_for_backward(q_TNH, k_TGH, v_TGH, out_TNH, lse_NT)
        ctx.cu_q, ctx.cu_kv, ctx.scale = cu_q, cu_kv, scale
        return out_TNH

    @staticmethod
    def backward(ctx, dout_TNH):
        grads = cpu_flash_backward(dout_TNH, *ctx.saved_tensors, ctx.cu_q, ctx.cu_kv, ctx.scale)
        return *grads, None, None, None


def _check_cpu(q_TNH) -> None:
    if q_TNH.device.type != "cpu":
        raise ValueError(f"backend 'cpu_flash' runs on CPU tensors; got {q_TNH.device} (use "
                         "'flash' or 'te' on CUDA)")
    if q_TNH.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"backend 'cpu_flash' supports float32, float64 and bfloat16; got "
                         f"{q_TNH.dtype}")


def cpu_flash_attention(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale):
    """Bottom-right causal attention per segment through ATen's CPU flash kernel (CPU only)."""
    _check_cpu(q_TNH)
    return CpuFlashChunkAttention.apply(q_TNH, k_TGH, v_TGH, list(cu_q), list(cu_kv),
                                        softmax_scale)


def cpu_flash_attention_lse(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale, causal=True):
    """cpu_flash_forward, checked: (out_TNH, lse_NT); cpu_flash_backward is its backward
    (attention/lse.py)."""
    _check_cpu(q_TNH)
    return cpu_flash_forward(q_TNH, k_TGH, v_TGH, cu_q, cu_kv, softmax_scale, causal)
